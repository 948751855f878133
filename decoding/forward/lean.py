"""A LLaMA-family decoder stepped directly: the model's own modules, called in the order its forward calls them.

Contract: ``supports(model)`` says whether ``model`` is a causal LM this module can step (``LEAN_MODEL_TYPES``,
laid out as transformers lays LLaMA out). ``forward(model, input_ids, position_ids, rows, attend)`` then
returns exactly, bit for bit, the logits ``model(input_ids=..., position_ids=..., logits_to_keep=rows)``
returns with ``attend`` as its attention function: the same modules (embedding, rotary embedding, norms,
projections, activation, output projection) run the same operations on the same tensors in the same order.
What it leaves out is the framework work around them: keyword plumbing through every module, mask builders,
output records, per-call checks. On the 2-core CPU a forward of SmolLM2-135M with packed linears
(``decoding.weights.linears``) took 0.84-0.99x the public forward's time this way, 1 to 16 tokens (docs/benchmarks.md,
"The lean step").

``attend(layer_idx, query, key, value, scaling)`` takes ``[1, heads, T, head_dim]`` queries and
``[1, kv_heads, T, head_dim]`` new keys/values (rotary applied), stores the keys/values wherever the caller
keeps its cache, and returns the attention output ``[1, T, heads, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from decoding.weights.linears import shared_kernel

# model_type values whose decoder layer is LLaMA's: pre-norm attention (q/k/v/o projections, rotate-half
# rotary) and a gated MLP, each added to the residual. Biases (Qwen2) live inside the projections.
LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def supports(model: PreTrainedModel) -> bool:
    """Whether ``forward`` can step ``model``: a LLaMA-family causal LM with LLaMA's module layout."""
    decoder = getattr(model, "model", None)
    if getattr(model.config, "model_type", None) not in LEAN_MODEL_TYPES or decoder is None:
        return False
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return False
    if not hasattr(model, "lm_head") or len(decoder.layers) == 0:
        return False
    return _has_layer_parts(decoder.layers[0])  # the layers of these architectures are all of one class


def _has_layer_parts(layer: torch.nn.Module) -> bool:
    if not all(hasattr(layer, name) for name in _LAYER_PARTS):
        return False
    return all(hasattr(layer.self_attn, name) for name in _ATTENTION_PARTS) and all(
        hasattr(layer.mlp, name) for name in _MLP_PARTS
    )


def forward(
    model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """The logits ``[len(rows), vocab]`` of the step rows ``rows`` for the tokens ``input_ids`` ``[T]`` at
    ``position_ids`` ``[T]`` (all on the model's device); ``attend`` runs each layer's attention."""
    decoder = model.model
    hidden = decoder.embed_tokens(input_ids[None])  # [1, T, hidden]
    cos, sin = decoder.rotary_emb(hidden, position_ids[None])  # [1, T, head_dim]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, T, head_dim]: broadcast over heads
    for layer in decoder.layers[: model.config.get_text_config(decoder=True).num_hidden_layers]:
        hidden = _attention_block(layer, hidden, cos, sin, attend)
        hidden = _mlp_block(layer, hidden)
    return model.lm_head(decoder.norm(hidden[:, rows]))[0]


def _attention_block(
    layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """``hidden + o_proj(attention(input_layernorm(hidden)))``, ``[1, T, hidden]`` in and out."""
    attention = layer.self_attn
    normed = layer.input_layernorm(hidden)
    query, key, value = _rotated_projections(attention, normed, cos, sin)
    output = attend(attention.layer_idx, query, key, value, attention.scaling)  # [1, T, heads, head_dim]
    output = output.reshape(*hidden.shape[:-1], -1).contiguous()
    return hidden + attention.o_proj(output)


def _rotated_projections(
    attention: torch.nn.Module, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and keys (rotary applied) and values, ``[1, heads, T, head_dim]`` each. Fused q/k/v projections
    (``decoding.weights.linears``) run as one product and rotate queries and keys together, element for element as
    rotating them apart does."""
    shape = (*normed.shape[:-1], -1, attention.head_dim)  # [1, T, heads, head_dim]
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    kernel = shared_kernel(projections)
    if kernel is None:
        query, key, value = (projection(normed).view(shape).transpose(1, 2) for projection in projections)
        return _rotate(query, cos, sin), _rotate(key, cos, sin), value
    heads = attention.q_proj.out_features // attention.head_dim
    kv_heads = attention.k_proj.out_features // attention.head_dim
    states = kernel(normed.reshape(-1, normed.shape[-1])).view(shape).transpose(1, 2)  # [1, all heads, T, dim]
    rotated = _rotate(states[:, : heads + kv_heads], cos, sin)
    return rotated[:, :heads], rotated[:, heads:], states[:, heads + kv_heads :]


def _mlp_block(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden + down_proj(act(gate_proj(x)) * up_proj(x))`` with ``x = post_attention_layernorm(hidden)``."""
    mlp = layer.mlp
    normed = layer.post_attention_layernorm(hidden)
    kernel = shared_kernel((mlp.gate_proj, mlp.up_proj))
    if kernel is None:
        gate, up = mlp.gate_proj(normed), mlp.up_proj(normed)
    else:
        both = kernel(normed.reshape(-1, normed.shape[-1])).view(*normed.shape[:-1], -1)  # [1, T, 2 * inner]
        gate, up = both.split(mlp.gate_proj.out_features, dim=-1)
    return hidden + mlp.down_proj(mlp.act_fn(gate) * up)


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form: ``states * cos + rotate_half(states) * sin``."""
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return (states * cos) + (rotated * sin)
