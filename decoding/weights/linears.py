"""A model's linear layers run by CPU kernels, with sibling projections fused into one GEMM.

Contract: ``replace_linears(model, make_kernel)`` swaps, in place, every ``nn.Linear`` of the decoder and the
output projection (``lm_head``) for a module that calls ``make_kernel(weight, bias)``'s kernel on the input's
rows, and returns the model. A kernel maps rows [M, K] to [M, N] for the weight [N, K]. Projections that read
the same input (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``) share one kernel over their
concatenated weights: the first of them called on an input computes all outputs, the others return their
slice when called on that same tensor object (any other input is computed afresh, so the result never depends
on the call order); once every member has taken its slice the group lets go of the input and the result. On
this 2-core CPU a one-token step is a few hundred small GEMMs; fusing halves their number. A tied embedding
keeps its table; only the output projection's matmul changes. A model with swapped linears cannot be saved.

``pack_float32(model)`` is the float32 layout the CPU preset uses (``PackedFloat32``); ``decoding.weights.quantize``
builds its int8 kernels on the same mechanism.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from decoding.errors import InvalidParameterError
from decoding.weights import native

FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

Kernel = Callable[[torch.Tensor], torch.Tensor]  # rows [M, K] -> [M, N]
KernelFactory = Callable[[torch.Tensor, "torch.Tensor | None"], Kernel]  # (weight [N, K], bias [N] | None)


class KernelLinear(nn.Module):
    """``y = x W^T + b`` computed by ``kernel`` on the rows of ``x`` ([..., K] -> [..., N])."""

    def __init__(self, kernel: Kernel, in_features: int, out_features: int) -> None:
        super().__init__()
        self.kernel, self.in_features, self.out_features = kernel, in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel(x.reshape(-1, self.in_features))  # [M, N]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={type(self.kernel).__name__}"


class _FusedGemm:
    """One kernel over sibling projections' weights, and the last input it was computed for."""

    def __init__(self, kernel: Kernel, in_features: int, members: int) -> None:
        self.kernel, self.in_features, self.members = kernel, in_features, members
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None  # [M, sum of out_features]
        self.served = 0

    def outputs_for(self, x: torch.Tensor) -> torch.Tensor:
        """The fused result for ``x``; the last of the members to ask for it releases it."""
        if self.input is not x:
            self.input, self.served = x, 0
            self.output = self.kernel(x.reshape(-1, self.in_features))
        output = self.output
        self.served += 1
        if self.served == self.members:
            self.input = self.output = None
        return output


class FusedLinear(nn.Module):
    """One projection of a group that shares a fused kernel: its columns ``start:stop`` of the result."""

    def __init__(self, fused: _FusedGemm, start: int, stop: int) -> None:
        super().__init__()
        self._fused, self.start, self.stop = fused, start, stop
        self.in_features, self.out_features = fused.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._fused.outputs_for(x)[:, self.start : self.stop]  # [M, out_features]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, columns={self.start}:{self.stop}"


def shared_kernel(modules: Sequence[nn.Module]) -> Kernel | None:
    """The one kernel computing ``modules``' outputs side by side (``[M, sum of out_features]``, in this order),
    when they are the whole of one fused group; None otherwise (call the modules one by one)."""
    if not modules or not all(isinstance(module, FusedLinear) for module in modules):
        return None
    fused = modules[0]._fused
    starts = [module.start for module in modules]
    stops = [module.stop for module in modules]
    if any(module._fused is not fused for module in modules) or len(modules) != fused.members:
        return None
    if starts[0] != 0 or starts[1:] != stops[:-1]:
        return None
    return fused.kernel


def _weights(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The concatenated float32 weights [sum N, K] of ``linears`` and their biases (zeros for those without;
    None if none has one)."""
    weight = torch.cat([linear.weight.detach().float() for linear in linears])
    if all(linear.bias is None for linear in linears):
        return weight, None
    bias = torch.cat(
        [
            linear.bias.detach().float() if linear.bias is not None else weight.new_zeros(linear.out_features)
            for linear in linears
        ]
    )
    return weight, bias


def kernel_linear(linear: nn.Linear, make_kernel: KernelFactory) -> KernelLinear:
    """``linear`` as a ``KernelLinear`` running ``make_kernel``'s kernel."""
    return KernelLinear(make_kernel(*_weights([linear])), linear.in_features, linear.out_features)


def install_fused(
    module: nn.Module, names: Sequence[str], kernel: Kernel, in_features: int, out_features: Sequence[int]
) -> None:
    """Set ``module``'s children ``names`` to ``FusedLinear``s sharing ``kernel``, which computes their outputs
    (``out_features`` each, in this order) side by side."""
    fused = _FusedGemm(kernel, in_features, len(names))
    start = 0
    for name, width in zip(names, out_features, strict=True):
        setattr(module, name, FusedLinear(fused, start, start + width))
        start += width


def _fuse_siblings(module: nn.Module, make_kernel: KernelFactory) -> None:
    """Replace each complete group of ``FUSED_GROUPS`` among ``module``'s children by ``FusedLinear``s."""
    children = dict(module.named_children())
    for names in FUSED_GROUPS:
        linears = [children.get(name) for name in names]
        if not all(isinstance(linear, nn.Linear) for linear in linears):
            continue
        if len({linear.in_features for linear in linears}) != 1:
            continue
        kernel = make_kernel(*_weights(linears))
        install_fused(module, names, kernel, linears[0].in_features, [linear.out_features for linear in linears])


def _replace_below(module: nn.Module, make_kernel: KernelFactory) -> None:
    """Swap every ``nn.Linear`` below ``module`` for a kernel module, fusing sibling projections."""
    _fuse_siblings(module, make_kernel)
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, kernel_linear(child, make_kernel))
        else:
            _replace_below(child, make_kernel)


def replace_linears(model: PreTrainedModel, make_kernel: KernelFactory) -> PreTrainedModel:
    """Run the decoder's linear layers and the output projection of ``model`` through ``make_kernel``'s kernels,
    in place; return the model."""
    _replace_below(model.get_decoder(), make_kernel)
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        model.set_output_embeddings(kernel_linear(head, make_kernel))
    return model


def is_float32_cpu(model: PreTrainedModel) -> bool:
    """Whether ``model``'s parameters are float32 on the CPU (judged by its first parameter)."""
    first = next(model.parameters())
    return first.device.type == "cpu" and first.dtype == torch.float32


def require_float32_cpu(model: PreTrainedModel, parameter: str, what: str) -> None:
    """Raise ``InvalidParameterError`` (``parameter``) unless ``model`` is float32 on the CPU."""
    if not is_float32_cpu(model):
        first = next(model.parameters())
        message = f"{what} needs a float32 CPU model, got {first.dtype} on {first.device}"
        raise InvalidParameterError(parameter, message)


# --- float32, laid out for the CPU ------------------------------------------------------------------------


class PackedFloat32:
    """``rows @ W^T + b`` in float32 from one copy of ``W`` laid out for the CPU.

    - Where the native panel kernel runs (``decoding.weights.native``): ``W`` in column panels only, every product on
      the kernel whatever the number of rows or threads (the kernel splits its panels over the native thread pool,
      ``decoding.weights.native.set_threads``, with the same bits at any count), streamed once for the call's rows.
      A whole forward of 2 tokens cost 1.1x one token's on the machine it was measured on, 4 tokens 1.2x, 8 tokens
      1.3x and 16 tokens 1.6x, and a 128-token prefill chunk no more than oneDNN's
      (docs/benchmarks.md, "One copy of the float32 weights"). A row's result is the same bit for bit whatever
      other rows share the call, so a token's logits do not depend on the size of the step (or prefill chunk)
      that computed it.
    - Without the panel kernel: ``W`` in oneDNN's blocked layout only (``torch.ops.mkldnn._reorder_linear_weight``,
      reordered once), oneDNN's matmul for every number of rows; each output row is a function of its own input
      row alone, bit for bit, one row included.

    Memory: one float32 copy of every weight.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.gemm = native.panel_gemm() if weight.shape[0] % native.PANEL == 0 else None
        self.panels = self.gemm.pack(weight) if self.gemm is not None else None
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.gemm is None else None
        self.bias = bias

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if self.gemm is None:
            return torch.ops.mkldnn._linear_pointwise(rows, self.blocked, self.bias, "none", [], "")
        out = self.gemm(rows, self.panels)
        return out if self.bias is None else out.add_(self.bias)


def packed_float32_available() -> bool:
    """Whether this torch build has the oneDNN (mkldnn) CPU kernels ``PackedFloat32`` uses."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_float32(model: PreTrainedModel) -> PreTrainedModel:
    """Run ``model``'s linear layers through ``PackedFloat32`` kernels, fusing siblings; in place, returns it.

    Raises ``InvalidParameterError`` (param ``weight_layout``) unless the model is float32 on the CPU and this
    torch build has oneDNN.
    """
    require_float32_cpu(model, "weight_layout", "the packed weight layout")
    if not packed_float32_available():
        raise InvalidParameterError("weight_layout", "the packed weight layout needs a torch build with oneDNN")
    return replace_linears(model, PackedFloat32)
