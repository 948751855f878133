"""Opt-in int8 weight quantization for the CPU, with rows that stay independent.

Contract: ``quantize_int8(model)`` replaces, in place, every ``nn.Linear`` of the decoder and the output
projection (``lm_head``) of a float32 CPU causal LM by int8 modules and returns the model. Each output row of
a quantized linear is a function of its own input row alone, bit for bit: a forward of k tokens gives each
token exactly what the same linear gives it alone. So lookahead decoding on a quantized model reproduces
greedy decoding on that same quantized model as faithfully as it does in float32 (the rest of the forward,
attention and norms, is unchanged float32). It does not reproduce the float32 model's greedy output: int8
weights perturb every logit by about 1% and a greedy continuation eventually takes another branch. A tied
embedding keeps its float32 table; only the output projection's matmul is quantized. A quantized model
cannot be saved.

How: weights are symmetric int8 per output channel, packed for fbgemm. Each activation row is scaled by its
own largest magnitude to [-63, 63] and split into a coarse integer part and a fine part (the rounding
remainder times 126, rounded), both exact small integers, so fbgemm's int8 GEMM with a fixed activation
scale of 1 consumes them without rounding: 2M rows through one GEMM, recombined in float32 (~13 bits of
activation precision, error dominated by the int8 weights). Values stay in [1, 127] after the zero point,
so AVX2's 16-bit pair sums cannot saturate. fbgemm's own dynamic quantization picks one scale per tensor,
which would make a row depend on the other rows of the step.

Projections that read the same input share one fused GEMM (``decoding.weights.linears``): on this 2-core AVX2 CPU
that halves the number of small GEMM calls, whose fixed cost dominates a one-token step.
"""

from __future__ import annotations

import warnings

import torch
from transformers import PreTrainedModel

from decoding.errors import InvalidParameterError
from decoding.weights.linears import replace_linears, require_float32_cpu

_COARSE = 63.0  # row scaled to [-63, 63]; + zero point 64 -> [1, 127]
_FINE = 126.0  # remainder in [-0.5, 0.5] scaled to [-63, 63]
_ZERO_POINT = 64
_TINY = 1e-30


def _pack(weight: torch.Tensor) -> torch.ScriptObject:
    """Quantize ``weight`` [N, K] to int8 per output channel (symmetric) and pack it for fbgemm."""
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [N]
    integers = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    zero_points = torch.zeros_like(scale, dtype=torch.long)
    engine = torch.backends.quantized.engine
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        quantized = torch._make_per_channel_quantized_tensor(integers, scale.double(), zero_points, 0)
        try:
            torch.backends.quantized.engine = "fbgemm"
            return torch.ops.quantized.linear_prepack(quantized, None)
        finally:
            torch.backends.quantized.engine = engine


def _split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` [M, K] -> (``parts`` [2M, K] of integers in [-63, 63], ``factor`` [M, 1]) such that
    ``rows ~= (parts[:M] + parts[M:] / 126) * factor``. Every row is handled on its own.

    Example: the row [2.0, -0.5] has factor 2/63; scaled it is [63, -15.75], coarse part [63, -16], fine
    part [0, 0.25 * 126 = 31.5 -> 32], and (-16 + 32/126) * 2/63 = -0.49987.
    """
    count = rows.shape[0]
    amax = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True).clamp_(min=_TINY)  # [M, 1]
    scaled = rows * (_COARSE / amax)  # [M, K] in [-63, 63]
    parts = rows.new_empty(2 * count, rows.shape[1])  # [2M, K]
    coarse = torch.round(scaled, out=parts[:count])
    torch.sub(scaled, coarse, out=parts[count:]).mul_(_FINE).round_()
    return parts, amax.mul_(1 / _COARSE)


def _int8_matmul(rows: torch.Tensor, packed: torch.ScriptObject, bias: torch.Tensor | None) -> torch.Tensor:
    """``rows @ W^T + bias`` for the packed int8 ``W`` [N, K]; ``rows`` [M, K] float32 -> [M, N]."""
    parts, factor = _split_rows(rows)
    both = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(parts, 1.0, _ZERO_POINT, packed)
    count = rows.shape[0]
    out = both[count:].div_(_FINE).add_(both[:count]).mul_(factor)  # [M, N]
    return out if bias is None else out.add_(bias)


class Int8Kernel:
    """``rows @ W^T + b`` with ``W`` int8 per output channel and per-row int8 activations (a
    ``decoding.weights.linears`` kernel: rows [M, K] float32 -> [M, N])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = _pack(weight)
        self.bias = bias

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return _int8_matmul(rows, self.packed, self.bias)


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Quantize the decoder's linear layers and the output projection of ``model`` in place; return it.

    Raises ``InvalidParameterError`` (param ``quantize``) unless the model is float32 on the CPU and this torch
    build has fbgemm.
    """
    require_float32_cpu(model, "quantize", "int8 quantization")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise InvalidParameterError("quantize", "int8 quantization needs a torch build with the fbgemm engine")
    return replace_linears(model, Int8Kernel)
