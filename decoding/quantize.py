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

Projections that read the same input (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``) share one
fused GEMM: the first of them called on an input computes all outputs, the others return their slice when
called on that same tensor object (any other input is computed afresh, so the result never depends on the
call order); once every member has taken its slice the group lets go of the input and the result. On this
2-core AVX2 CPU that halves the number of small GEMM calls, whose fixed cost dominates a one-token step.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from decoding.errors import InvalidParameterError

FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
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


def _bias(linears: Sequence[nn.Linear]) -> torch.Tensor | None:
    """The concatenated float32 biases of ``linears`` (zeros for those without), or None if none has one."""
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat(
        [
            linear.bias.detach().float() if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
            for linear in linears
        ]
    )


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with int8 weights (per output channel) and per-row int8 activations."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed = _pack(linear.weight.detach().float())
        self.register_buffer("bias", _bias([linear]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _int8_matmul(x.reshape(-1, self.in_features), self._packed, self.bias)  # [M, N]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class _FusedGemm:
    """The packed weights of sibling projections and the last input they were computed for."""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        self.in_features = linears[0].in_features
        self.packed = _pack(torch.cat([linear.weight.detach().float() for linear in linears]))
        self.bias = _bias(linears)
        self.members = len(linears)
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None  # [M, sum of out_features]
        self.served = 0

    def outputs_for(self, x: torch.Tensor) -> torch.Tensor:
        """The fused result for ``x``; the last of the members to ask for it releases it."""
        if self.input is not x:
            self.input, self.served = x, 0
            self.output = _int8_matmul(x.reshape(-1, self.in_features), self.packed, self.bias)
        output = self.output
        self.served += 1
        if self.served == self.members:
            self.input = self.output = None
        return output


class FusedInt8Linear(nn.Module):
    """One projection of a group that shares a fused int8 GEMM: its columns ``start:stop`` of the result."""

    def __init__(self, fused: _FusedGemm, start: int, stop: int) -> None:
        super().__init__()
        self._fused, self.start, self.stop = fused, start, stop
        self.in_features, self.out_features = fused.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._fused.outputs_for(x)[:, self.start : self.stop]  # [M, out_features]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, columns={self.start}:{self.stop}"


def _fuse_siblings(module: nn.Module) -> None:
    """Replace each complete group of ``FUSED_GROUPS`` among ``module``'s children by ``FusedInt8Linear``s."""
    children = dict(module.named_children())
    for names in FUSED_GROUPS:
        linears = [children.get(name) for name in names]
        if not all(isinstance(linear, nn.Linear) for linear in linears):
            continue
        if len({linear.in_features for linear in linears}) != 1:
            continue
        fused, start = _FusedGemm(linears), 0
        for name, linear in zip(names, linears, strict=True):
            setattr(module, name, FusedInt8Linear(fused, start, start + linear.out_features))
            start += linear.out_features


def _replace_linears(module: nn.Module) -> None:
    """Swap every ``nn.Linear`` below ``module`` for an int8 module, fusing sibling projections."""
    _fuse_siblings(module)
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
        else:
            _replace_linears(child)


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Quantize the decoder's linear layers and the output projection of ``model`` in place; return it.

    Raises ``InvalidParameterError`` (param ``quantize``) unless the model is float32 on the CPU and this torch
    build has fbgemm.
    """
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        message = f"int8 quantization needs a float32 CPU model, got {parameter.dtype} on {parameter.device}"
        raise InvalidParameterError("quantize", message)
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise InvalidParameterError("quantize", "int8 quantization needs a torch build with the fbgemm engine")
    _replace_linears(model.get_decoder())
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        model.set_output_embeddings(Int8Linear(head))
    return model
