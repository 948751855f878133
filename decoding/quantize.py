"""Opt-in int8 weight quantization for the CPU whose rows stay independent.

Contract: ``quantize_int8(model)`` replaces, in place, every ``nn.Linear`` of the decoder and the output
projection (``lm_head``) of a float32 CPU causal LM by an ``Int8Linear`` and returns the model. Each output
row of an ``Int8Linear`` is a function of its own input row alone, bit for bit: a forward of k tokens gives
each token exactly the values it gets alone. So on a quantized model lookahead decoding still reproduces
greedy decoding token for token (the quantized model's greedy, not the float32 model's). A tied embedding
keeps its float32 table: only the output projection's matmul is quantized.

How: weights are symmetric int8 per output channel; each activation row is divided by its largest magnitude
and two pinned columns (-1, +1) are appended, so fbgemm's dynamic quantization, which picks one range per
tensor, always picks [-1, 1]: in effect a fixed 7-bit quantization of every row by its own scale, undone
after the int8 GEMM. Plain per-tensor dynamic quantization (``quantize_dynamic``) is faster by a few
microseconds per layer but shares one scale across the rows of a step, so a row's logits depend on the other
rows and lookahead stops matching greedy.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers import PreTrainedModel

_PINS = 2  # extra input columns holding -1 and +1


def _fbgemm_pack(weight: torch.Tensor) -> object:
    """Quantize ``weight`` [N, K] to int8 per output channel (symmetric) and pack it for fbgemm."""
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [N]
    quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    zero_points = torch.zeros_like(scale, dtype=torch.long)
    engine = torch.backends.quantized.engine
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        packed_weight = torch._make_per_channel_quantized_tensor(quantized, scale.double(), zero_points, 0)
        try:
            torch.backends.quantized.engine = "fbgemm"
            return torch.ops.quantized.linear_prepack(packed_weight, None)
        finally:
            torch.backends.quantized.engine = engine


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with int8 weights (per output channel) and int8 activations (per row)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        padded = torch.cat([weight, weight.new_zeros(self.out_features, _PINS)], dim=1)  # [N, K + 2]
        self._packed = _fbgemm_pack(padded)
        self.register_buffer("pins", torch.tensor([-1.0, 1.0]), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        amax = torch.linalg.vector_norm(rows, ord=float("inf"), dim=1, keepdim=True).clamp_(min=1e-12)  # [M, 1]
        padded = torch.cat([rows / amax, self.pins.expand(rows.shape[0], _PINS)], dim=1)  # [M, K + 2] in [-1, 1]
        out = torch.ops.quantized.linear_dynamic(padded, self._packed, True).mul_(amax)  # [M, N]
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _replace_linears(module: nn.Module) -> int:
    """Swap every ``nn.Linear`` below ``module`` for an ``Int8Linear``; return how many were swapped."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
            count += 1
        else:
            count += _replace_linears(child)
    return count


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Quantize the decoder's linear layers and the output projection of ``model`` in place; return it.

    Raises ``ValueError`` unless the model is float32 on the CPU and this torch build has fbgemm.
    """
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        raise ValueError(f"int8 quantization needs a float32 CPU model, got {parameter.dtype} on {parameter.device}")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("int8 quantization needs a torch build with the fbgemm quantized engine")
    _replace_linears(model.get_decoder())
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        model.set_output_embeddings(Int8Linear(head))
    return model
