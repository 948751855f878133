"""A LLaMA-family CPU step with the small operations fused: one native call each for a layer's norms, rotary
embedding, attention and gated activation, around the native products of ``decoding.weights.linears``.

Contract: ``plan_for(model)`` returns a ``FusedPlan`` when ``model`` can step this way (a ``decoding.forward.lean``
model on the CPU in float32 whose projections are native kernels, fused q/k/v and gate/up, SiLU, head size a
multiple of 8 up to 256, and the native library built), else None. ``FusedPlan.forward(slices)`` then does what
``decoding.forward.packed.forward_packed`` does for those slices (each slice's keys/values appended to its own cache,
its kept rows' logits returned, in order) with the same operations in a different arithmetic order: logits agree
with the eager forward's to float tolerance, not bit for bit.

Why: a one-token step of SmolLM2-135M on the GGUF weights spent ~12.5 ms in its 121 products and as long again
dispatching ~1,250 small ATen ops (norms, rotary, attention, activation, views) from Python; here a layer is
its four products, five native calls and two additions (docs/journal.md, "the fused CPU step"). A step (a decode
step or a prompt chunk) runs all its layers in one native call (``csrc/fused_step.cpp``: the same calls in the same
order, without ~270 trips through ctypes and Python between them: ~16 -> ~12 ms a one-token step on the 2-core Xeon,
and the thread pool's workers stay busy); without the native step layers (``step_layers`` None) it goes layer by
layer through the same calls.

Exactness: every native call computes a row from that row alone, and attention visits a row's visible keys in
position order with an exact two-pass softmax, so a token's logits are the same bits in a one-token step and in
a lookahead step whose mask shows it the same tokens: greedy lookahead equals greedy exactly. Prompt chunks attend
natively too, so a prompt's keys, values and first token are the same bits however it was cut into chunks or how much
of it came from the prefix cache: the same greedy request gives the same text twice (with 8-bit activations a float
difference upstream can round a value the other way and tip a near tie; torch's SDPA for long chunks did, in the soak
test). The native attention's cost grows with rows x past; scoring a row's query heads of one kv head together, a
prompt of 1024 tokens prefills in ~0.7x the time SDPA took (2-core AMD EPYC, 2026-12-07).

Threads: each native call splits its work over the native thread pool (``decoding.weights.native.set_threads``) with the
same bits at any thread count, so the exactness above holds at every count; a wide step's products, which are
bound by arithmetic on one thread, gain the most.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from decoding.forward import lean
from decoding.forward.kv_cache import CacheOverflowError, SlotCache
from decoding.weights import native
from decoding.weights.linears import KernelLinear, PackedFloat32, is_float32_cpu, shared_kernel
from decoding.weights.quant_panels import QuantKernel

if TYPE_CHECKING:
    from decoding.forward.slices import Slice

MAX_HEAD_DIM = 256  # the widest attention head planned for (native attention: any multiple of 8, tested to 128)

_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parts, as the fused step calls them."""

    input_norm: torch.Tensor  # [hidden]
    qkv: object  # rows [T, hidden] -> [T, (heads + 2 kv_heads) * dim]
    output: object  # rows [T, heads * dim] -> [T, hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: object  # rows [T, hidden] -> [T, 2 * inner]
    down: object  # rows [T, inner] -> [T, hidden]


@dataclass(frozen=True)
class _Step:
    """One forward's slices, their masks (``[t, t]`` bytes, None: causal), rotary tables ``[T, dim]`` and the
    layers' scratch rows (``normed`` [T, hidden], ``attended`` [T, heads * dim], ``activated`` [T, inner])."""

    slices: Sequence[Slice]
    masks: list[torch.Tensor | None]
    cos: torch.Tensor
    sin: torch.Tensor
    normed: torch.Tensor
    attended: torch.Tensor
    activated: torch.Tensor


class FusedPlan:
    """A model's layers prepared for the fused step (see the module contract)."""

    def __init__(self, model: PreTrainedModel, ops: native.FusedOps, layers: list[_Layer],
                 step_layers: ctypes.Array | None = None) -> None:
        config = model.config.get_text_config(decoder=True)
        attention = model.model.layers[0].self_attn
        self.model, self.ops, self.layers = model, ops, layers
        self.dim = attention.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.scaling = float(attention.scaling)
        self.eps = float(config.rms_norm_eps)
        self.inner = config.intermediate_size
        self.final_norm = model.model.norm.weight.detach()
        self.step_layers = step_layers  # the layers for one native call (``_native_layers``); None: call by call

    def forward(self, slices: Sequence[Slice]) -> list[torch.Tensor]:
        """Each slice's kept logits ``[rows, vocab]``, in order; each slice's cache grows by its token count.
        Raises ``CacheOverflowError`` (nothing written) when a cache would overflow."""
        for slice_ in slices:
            _reserve(slice_.cache, len(slice_.tokens), self.kv_heads, self.dim)
        tokens = [token for slice_ in slices for token in slice_.tokens]
        positions = torch.cat([slice_.position_tensor() for slice_ in slices])
        decoder = self.model.model
        hidden = decoder.embed_tokens(torch.tensor(tokens))  # [T, hidden]
        cos, sin = decoder.rotary_emb(hidden[None], positions[None])  # [1, T, dim]
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        count, masks = hidden.shape[0], [_visible_bytes(slice_) for slice_ in slices]
        if self.step_layers is not None:
            self._native_layers(hidden, slices, masks, cos, sin)
        else:
            step = _Step(slices, masks, cos, sin, torch.empty_like(hidden), torch.empty((count, self.heads * self.dim)),
                         torch.empty((count, self.inner)))
            for index, layer in enumerate(self.layers):
                self._layer(index, layer, hidden, step)
        for slice_ in slices:
            slice_.cache.advance(len(slice_.tokens))
        rows, start = [], 0
        for slice_ in slices:
            rows.append(slice_.row_tensor() + start)
            start += len(slice_.tokens)
        kept = hidden[torch.cat(rows)]
        normed = torch.empty_like(kept)
        self.ops.rms_norm(kept.data_ptr(), kept.shape[0], kept.shape[1], self.final_norm.data_ptr(), self.eps,
                          normed.data_ptr())
        logits = self.model.lm_head(normed)
        return list(torch.split(logits, [slice_.row_count for slice_ in slices]))

    def _native_layers(self, hidden: torch.Tensor, slices: Sequence[Slice], masks: list[torch.Tensor | None],
                       cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Every layer of a decode step (no prompt chunk among its ``slices``; ``masks`` their visibility bytes)
        in one native call (``csrc/fused_step.cpp``): what ``_layer`` does layer by layer, the same kernels in the
        same order, without its scratch tensors (the native call keeps its own)."""
        entries, start = [], 0
        for slice_, mask in zip(slices, masks, strict=True):
            keys, values, stride = _buffer_tables(slice_.cache, len(self.layers))
            count = len(slice_.tokens)
            entries.append(native.StepSlice(start, count, slice_.cache.length, 0 if mask is None else mask.data_ptr(),
                                            keys, values, stride))
            start += count
        table = (native.StepSlice * len(entries))(*entries)
        self.ops.step_layers(hidden.data_ptr(), hidden.shape[0], hidden.shape[1], self.step_layers,
                             len(self.layers), table, len(entries), self.heads, self.kv_heads, self.dim, self.inner,
                             self.eps, self.scaling, cos.data_ptr(), sin.data_ptr())

    def _layer(self, index: int, layer: _Layer, hidden: torch.Tensor, step: _Step) -> None:
        """``hidden`` [T, hidden] through decoder layer ``index``, in place: attention (keys/values stored), then
        the MLP."""
        ops, count, width, normed = self.ops, hidden.shape[0], hidden.shape[1], step.normed
        ops.rms_norm(hidden.data_ptr(), count, width, layer.input_norm.data_ptr(), self.eps, normed.data_ptr())
        states = layer.qkv(normed)  # [T, (heads + 2 kv_heads) * dim]
        ops.rope(states.data_ptr(), count, states.shape[1], self.heads + self.kv_heads, self.dim, step.cos.data_ptr(),
                 step.sin.data_ptr())
        start = 0
        for slice_, mask in zip(step.slices, step.masks, strict=True):
            end = start + len(slice_.tokens)
            self._attend(index, slice_, mask, states[start:end], step.attended[start:end])
            start = end
        hidden.add_(layer.output(step.attended))
        ops.rms_norm(hidden.data_ptr(), count, width, layer.post_norm.data_ptr(), self.eps, normed.data_ptr())
        both = layer.gate_up(normed)  # [T, 2 * inner]
        ops.silu_mul(both.data_ptr(), count, self.inner, step.activated.data_ptr())
        hidden.add_(layer.down(step.activated))

    def _attend(
        self, index: int, slice_: Slice, mask: torch.Tensor | None, states: torch.Tensor, out: torch.Tensor
    ) -> None:
        """One slice's attention in layer ``index``: its keys/values stored at the cache's length, its rows of
        ``states`` attended into ``out`` ([t, heads * dim], a contiguous block of rows)."""
        layer = slice_.cache.layers[index]
        keys, values = layer._key_buffer[0], layer._value_buffer[0]  # [kv_heads, capacity, dim]
        count, past = states.shape[0], slice_.cache.length
        pointer = 0 if mask is None else mask.data_ptr()
        self.ops.attention(states.data_ptr(), count, states.shape[1], self.heads, self.kv_heads, self.dim,
                           keys.data_ptr(), values.data_ptr(), keys.stride(0), past, pointer, self.scaling,
                           out.data_ptr())


def _reserve(cache: SlotCache, count: int, kv_heads: int, dim: int) -> None:
    """Check ``cache`` has room for ``count`` more slots and that its buffers exist (allocated as on a first
    ``update``); flush its pool's deferred commits so its keys are current."""
    if cache.length + count > cache.capacity:
        raise CacheOverflowError(f"KV cache capacity {cache.capacity} exceeded ({cache.length + count} slots needed)")
    if cache.pool is not None:
        cache.pool.flush()
    for layer in cache.layers:
        if not layer.is_initialized:
            shape = torch.empty((1, kv_heads, 0, dim))
            layer.lazy_initialization(shape, shape)


def _buffer_tables(cache: SlotCache, layers: int) -> tuple[ctypes.Array, ctypes.Array, int]:
    """The addresses of ``cache``'s first ``layers`` layers' key and value buffers (ctypes arrays) and their head
    stride, made on the cache's first step and kept on it (``SlotCache.native_tables``: bound buffers never move;
    building them took ~35 us a step). The layers must be bound (``_reserve``)."""
    tables = cache.native_tables
    if tables is None or len(tables[0]) != layers:
        bound = cache.layers[:layers]
        keys = (ctypes.c_void_p * layers)(*(layer._key_buffer[0].data_ptr() for layer in bound))
        values = (ctypes.c_void_p * layers)(*(layer._value_buffer[0].data_ptr() for layer in bound))
        tables = cache.native_tables = (keys, values, bound[0]._key_buffer[0].stride(0))
    return tables


def _visible_bytes(slice_: Slice) -> torch.Tensor | None:
    """A slice's ``[t, t]`` visibility as contiguous bytes (None: causal)."""
    visible = slice_.visible_mask()
    return None if visible is None else visible.to(torch.uint8).contiguous()


def plan_for(model: PreTrainedModel) -> FusedPlan | None:
    """``model``'s ``FusedPlan`` (made once per model), or None where the fused step cannot run it."""
    if model not in _PLANS:
        _PLANS[model] = _make_plan(model)
    return _PLANS[model]


def _make_plan(model: PreTrainedModel) -> FusedPlan | None:
    ops = native.fused_ops()
    if ops is None or not lean.supports(model) or not is_float32_cpu(model):
        return None
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "hidden_act", None) != "silu" or config.hidden_size % 8:
        return None
    if not isinstance(model.lm_head, KernelLinear) or not _plain_norm(model.model.norm):
        return None
    layers = []
    for layer in model.model.layers[: config.num_hidden_layers]:
        attention, mlp = layer.self_attn, layer.mlp
        qkv = shared_kernel((attention.q_proj, attention.k_proj, attention.v_proj))
        gate_up = shared_kernel((mlp.gate_proj, mlp.up_proj))
        singles = (attention.o_proj, mlp.down_proj)
        if qkv is None or gate_up is None or not all(isinstance(single, KernelLinear) for single in singles):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if attention.head_dim % 8 or attention.head_dim > MAX_HEAD_DIM or not all(map(_plain_norm, norms)):
            return None
        layers.append(_Layer(layer.input_layernorm.weight.detach(), qkv, attention.o_proj.kernel,
                             layer.post_attention_layernorm.weight.detach(), gate_up, mlp.down_proj.kernel))
    return FusedPlan(model, ops, layers, _step_layers(layers))


def _step_layers(layers: Sequence[_Layer]) -> ctypes.Array | None:
    """``layers`` as ``csrc/fused_step.cpp`` takes them, or None when a product is not a native panel kernel (an
    int8 or oneDNN one: the step then calls layer by layer). The array points into the layers' tensors, which the
    plan keeps."""
    gemm = native.panel_gemm()
    if gemm is None:
        return None
    table = []
    for layer in layers:
        products = [_step_product(gemm, kernel) for kernel in (layer.qkv, layer.output, layer.gate_up, layer.down)]
        if None in products:
            return None
        table.append(native.StepLayer(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), *products))
    return (native.StepLayer * len(table))(*table)


def _step_product(gemm: native.PanelGemm, kernel: object) -> native.StepProduct | None:
    """A native kernel of ``gemm`` as one product of the native step; None for any other kernel."""
    bias = getattr(kernel, "bias", None)
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()):
        return None
    bias_address = 0 if bias is None else bias.data_ptr()
    if isinstance(kernel, QuantKernel) and kernel.gemm is gemm:
        panels = kernel.panels
        return native.StepProduct(gemm.entry_address(kernel.lanes, quantized=True), kernel.format.kind,
                                  panels.data_ptr(), panels.shape[0] * kernel.lanes, kernel.in_features, bias_address)
    if isinstance(kernel, PackedFloat32) and kernel.gemm is gemm and kernel.panels is not None:
        panels = kernel.panels  # [N / L, K, L]
        return native.StepProduct(gemm.entry_address(panels.shape[2], quantized=False), -1, panels.data_ptr(),
                                  panels.shape[0] * panels.shape[2], panels.shape[1], bias_address)
    return None


def _plain_norm(norm: torch.nn.Module) -> bool:
    """A LLaMA RMS norm: a float32 weight and an epsilon, nothing else."""
    weight = getattr(norm, "weight", None)
    return weight is not None and weight.dtype == torch.float32 and weight.is_contiguous() and hasattr(
        norm, "variance_epsilon"
    )
