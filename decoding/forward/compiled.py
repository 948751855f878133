"""The lean CPU forward with the dense work between two attentions compiled by ``torch.compile`` (inductor).

Contract: ``CompiledForward.build(model)`` returns a ``CompiledForward`` for a model whose layers ``supports`` accepts
(a ``decoding.forward.lean`` LLaMA-family model, float32 on the CPU, every layer's q/k/v and gate/up fused over one
native kernel, ``decoding.weights.linears`` / ``decoding.weights.gguf_model``, of one shape and format per role, SiLU),
else None. Called as ``decoding.forward.lean.forward`` is (``(model, input_ids, position_ids, rows, attend)`` -> the
logits of ``rows``), it computes the same function: the embedding, rotary tables, attention (``attend``: the KV-cache
writes and the per-slice attention), final norm and output projection run eagerly as ``lean.forward`` runs them; the
work between two attentions (output projection, residual, RMS norm, the gated MLP, the next layer's norm, q/k/v
projection and rotary embedding) is one compiled graph over that layer's tensors, the native GEMMs inside it as the
``lookahead::*`` ops of ``decoding.weights.native``. The graphs take the layers' tensors as arguments (one graph for
every layer; guards on tensors alone) and the step's token count as their one dynamic size: a graph for one-token steps
and one for any other count (torch specializes a size of 1). The first call of each shape compiles it (seconds to
minutes on a small CPU; inductor's on-disk cache keeps them across processes).

Exactness: every output row is a function of its own input row (no reduction crosses rows), so lookahead ==
greedy holds under it as it does eagerly; results may differ from the eager forward's in the last bits (inductor
sums a norm in another order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from decoding.forward import lean
from decoding.forward.lean import Attend
from decoding.weights.linears import PackedFloat32, shared_kernel
from decoding.weights.quant_panels import QuantKernel


class Gemm(NamedTuple):
    """The static part of one native product: the block format (None: float32 panels), panel width, depth."""

    kind: int | None
    lanes: int
    depth: int


class LayerSpec(NamedTuple):
    """What a compiled graph bakes in, the same for every layer: the four products, head counts, norm epsilon."""

    qkv: Gemm
    output: Gemm
    gate_up: Gemm
    down: Gemm
    heads: int
    kv_heads: int
    head_dim: int
    inner: int
    epsilon: float


class LayerTensors(NamedTuple):
    """One layer's tensors, the compiled graphs' arguments: norm weights, packed weights and biases (or None)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    output: torch.Tensor
    output_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


Projections = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm: Gemm) -> torch.Tensor:
    """``rows`` [M, K] times one packed weight (``decoding.weights.native``'s ops), plus ``bias``: [M, N]."""
    if gemm.kind is None:
        out = torch.ops.lookahead.panel_gemm(rows, weight)
    else:
        out = torch.ops.lookahead.quant_gemm(rows, weight, gemm.kind, gemm.lanes, gemm.depth)
    return out if bias is None else out + bias


def _norm(hidden: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """LLaMA's RMS norm (``LlamaRMSNorm`` in float32)."""
    return weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + epsilon))


def attention_inputs(
    spec: LayerSpec, layer: LayerTensors, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> Projections:
    """Queries, keys (rotary applied) and values ``[1, heads, T, head_dim]`` for ``hidden`` [1, T, hidden]."""
    count = hidden.shape[1]
    normed = _norm(hidden, layer.input_norm, spec.epsilon).reshape(count, -1)
    states = _product(normed, layer.qkv, layer.qkv_bias, spec.qkv)
    states = states.view(1, count, -1, spec.head_dim).transpose(1, 2)  # [1, all heads, T, head_dim]
    rotated = lean._rotate(states[:, : spec.heads + spec.kv_heads], cos, sin)
    return rotated[:, : spec.heads], rotated[:, spec.heads :], states[:, spec.heads + spec.kv_heads :]


def layer_rest(spec: LayerSpec, layer: LayerTensors, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The layer after its attention (``attended`` [1, T, heads, head_dim]): output projection and residual, then
    the gated MLP block. ``[1, T, hidden]``."""
    count = hidden.shape[1]
    hidden = hidden + _product(attended.reshape(count, -1), layer.output, layer.output_bias, spec.output)[None]
    normed = _norm(hidden, layer.post_norm, spec.epsilon).reshape(count, -1)
    gate, up = _product(normed, layer.gate_up, layer.gate_up_bias, spec.gate_up).split(spec.inner, dim=-1)
    return hidden + _product(torch.nn.functional.silu(gate) * up, layer.down, layer.down_bias, spec.down)[None]


def between(
    spec: LayerSpec,
    layer: LayerTensors,
    following: LayerTensors,
    hidden: torch.Tensor,
    attended: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer_rest`` of ``layer``, then ``attention_inputs`` of ``following``: (hidden, queries, keys, values)."""
    hidden = layer_rest(spec, layer, hidden, attended)
    return (hidden, *attention_inputs(spec, following, hidden, cos, sin))


def _gemm(kernel: object) -> tuple[Gemm, torch.Tensor, torch.Tensor | None] | None:
    """A native kernel's static part, packed weight and bias; None for any other kernel."""
    if isinstance(kernel, QuantKernel):
        return Gemm(kernel.format.kind, kernel.lanes, kernel.in_features), kernel.panels, kernel.bias
    if isinstance(kernel, PackedFloat32) and kernel.panels is not None:
        return Gemm(None, kernel.panels.shape[2], kernel.panels.shape[1]), kernel.panels, kernel.bias
    return None


def _layer(layer: torch.nn.Module) -> tuple[LayerSpec, LayerTensors] | None:
    """``layer``'s spec and tensors, or None when the compiled graphs cannot run it."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv = _gemm(shared_kernel((attention.q_proj, attention.k_proj, attention.v_proj)))
    gate_up = _gemm(shared_kernel((mlp.gate_proj, mlp.up_proj)))
    output, down = _gemm(getattr(attention.o_proj, "kernel", None)), _gemm(getattr(mlp.down_proj, "kernel", None))
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if None in (qkv, gate_up, output, down):
        return None
    epsilons = {getattr(norm, "variance_epsilon", None) for norm in norms}
    if len(epsilons) != 1 or None in epsilons:
        return None
    head_dim = attention.head_dim
    spec = LayerSpec(qkv[0], output[0], gate_up[0], down[0], attention.q_proj.out_features // head_dim,
                     attention.k_proj.out_features // head_dim, head_dim, mlp.gate_proj.out_features, epsilons.pop())
    tensors = LayerTensors(norms[0].weight.detach(), *qkv[1:], *output[1:], norms[1].weight.detach(), *gate_up[1:],
                           *down[1:])
    return spec, tensors


def compile_graph(function: Callable) -> Callable:
    """``torch.compile`` of one of the graph functions: whole graphs, guards on tensors only (the spec and the
    structure are checked once, by ``CompiledForward.build``)."""
    options = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}
    return torch.compile(function, fullgraph=True, options=options)


def _token_dim(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor`` with its dim ``dim`` (the step's token count) marked as the graphs' dynamic size, so that the
    first multi-token call compiles one graph for every count."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return tensor


class CompiledForward:
    """``decoding.forward.lean.forward`` with the work between attentions compiled (see the module contract)."""

    def __init__(self, spec: LayerSpec, layers: list[LayerTensors], compile: Callable[[Callable], Callable]) -> None:
        self.spec, self.layers = spec, layers
        self._inputs, self._between, self._rest = compile(attention_inputs), compile(between), compile(layer_rest)

    @classmethod
    def build(
        cls, model: PreTrainedModel, compile: Callable[[Callable], Callable] = compile_graph
    ) -> CompiledForward | None:
        """The compiled forward of ``model``, or None where it cannot run it (see the module contract).
        ``compile`` turns each graph function into what runs (tests pass the identity: the same functions, eager)."""
        first = next(model.parameters())
        if not lean.supports(model) or first.device.type != "cpu" or first.dtype != torch.float32:
            return None
        if getattr(model.config.get_text_config(decoder=True), "hidden_act", None) not in ("silu", "swish"):
            return None
        decoder = model.model
        layers = [_layer(layer) for layer in decoder.layers[: _layer_count(model)]]
        if any(layer is None for layer in layers) or len({spec for spec, _ in layers}) != 1:
            return None
        return cls(layers[0][0], [tensors for _, tensors in layers], compile)

    def __call__(
        self, model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        decoder, spec = model.model, self.spec
        hidden = decoder.embed_tokens(input_ids[None])  # [1, T, hidden]
        cos, sin = decoder.rotary_emb(hidden, position_ids[None])  # [1, T, head_dim]
        cos, sin = _token_dim(cos.unsqueeze(1), 2), _token_dim(sin.unsqueeze(1), 2)  # [1, 1, T, head_dim]
        query, key, value = self._inputs(spec, self.layers[0], _token_dim(hidden, 1), cos, sin)
        modules = decoder.layers
        for index, layer in enumerate(self.layers):
            attention = modules[index].self_attn
            attended = _token_dim(attend(attention.layer_idx, query, key, value, attention.scaling), 1)
            hidden = _token_dim(hidden, 1)
            if index + 1 < len(self.layers):
                hidden, query, key, value = self._between(spec, layer, self.layers[index + 1], hidden, attended,
                                                          cos, sin)
            else:
                hidden = self._rest(spec, layer, hidden, attended)
        return model.lm_head(decoder.norm(hidden[:, rows]))[0]


def _layer_count(model: PreTrainedModel) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers
