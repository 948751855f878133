"""The static step's forward: one LLaMA-family forward of fixed shapes, written as plain torch with no host sync.

Contract: ``prepare_weights(model)`` lays a ``supports`` model's weights out for ``static_forward`` (q/k/v fused with
the rotary's rotate-half folded in as extra columns, gate/up fused; the modules' own ``nn.Linear`` weights become
views of the fused matrices, so the model is held once). ``static_forward(weights, caches, inputs, sequences,
tokens)`` runs ``sequences`` x ``tokens`` step tokens whose every varying value is data in the int64 ``inputs``
buffer (fields ``TOKEN_FIELDS`` of ``sequences * tokens`` ints, then ``SEQUENCE_FIELDS`` of ``sequences``): it
builds the attention mask on the device from each token's parent, writes the step's keys/values into the KV pool
views ``caches`` by index, attends over their length, and returns the logits of the rows read and their ids: each
row's argmax and, with ``top_k``, its best ``top_k`` ids, in one buffer (``row_ids``).
No Python value depends on the step's data, so ``torch.compile(fullgraph=True, dynamic=False)`` traces it into one
graph per shape and a CUDA graph can capture it. About 21 ATen ops a layer. On CUDA's path, where the tree kernel
takes the model's heads (``prepare_weights``' ``tree_kernel``), a layer's rotary, key/value write, gathers, mask and
attention are instead one op, ``decoding.forward.tree_attention`` (one Triton kernel on a GPU), over q/k/v without
the rotate-half columns: about 10.5 ATen ops a layer eagerly (views included), 8 kernels compiled
(``bench.kernels``), and per step one op for the tree's reach (``tree_reach``) where the mask and its closure were.
The runner around it (buckets, the input buffer, capture): ``decoding.forward.static``.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from decoding.forward import lean
from decoding.forward.tree_attention import (
    ancestors,
    eligible,
    mask_from_reach,
    tree_attention,
    tree_reach,
    triton_available,
)

# The input buffer's fields, in order: four of ``sequences * tokens`` ints, then two of ``sequences`` (a token's keys
# and values go to its sequence's pool row, at the sequence's length plus the token's index: derived on the device).
TOKEN_FIELDS = ("token_ids", "positions", "parents", "read_rows")
SEQUENCE_FIELDS = ("lengths", "rows")


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights, laid out for ``static_forward`` (``[in, out]`` matrices)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [hidden, 2 * (heads + 2 kv) * d]: q, k, v, then q, k rotated half and zeros for v
    qkv_bias: torch.Tensor | None
    out: torch.Tensor  # [heads * d, hidden]
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [hidden, 2 * inner]
    down: torch.Tensor  # [inner, hidden]


@dataclass(frozen=True)
class StaticWeights:
    """What ``static_forward`` reads of a model: its layers' fused weights and the shapes around them."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[_Layer, ...]
    norm: torch.Tensor
    head: torch.Tensor  # [hidden, vocab]
    inv_freq: torch.Tensor  # [d / 2] float32
    rope_scale: float
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    fold_groups: bool  # fold grouped query heads into the query length (CUDA's memory-efficient kernel), token-major
    cuda_layout: bool  # attention outputs laid out as CUDA's kernels return them (a rehearsal's, off CUDA)
    unrotated: torch.Tensor  # [1, 2, 1, d]: cos 1, sin 0 (the v heads' "rotation"), on the device
    kv_columns: torch.Tensor  # arange(2 kv) on the device: the pool's key and value heads
    tree_kernel: bool = False  # attention through ``decoding.forward.tree_attention`` (q/k/v not doubled, not folded)


def supports(model: PreTrainedModel) -> bool:
    """Whether ``StaticStep`` can run ``model``: a ``decoding.forward.lean`` model with ``nn.Linear`` projections, SiLU
    gates, no output or MLP biases and default (or llama3-style, precomputed) rotary frequencies."""
    if not lean.supports(model):
        return False
    config = model.config.get_text_config(decoder=True)
    layer = model.model.layers[0]
    linears = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
               layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, model.lm_head)
    if not all(type(linear) is nn.Linear for linear in linears):
        return False
    unbiased = (layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, model.lm_head)
    rotary = model.model.rotary_emb
    return (getattr(config, "hidden_act", "silu") == "silu" and all(linear.bias is None for linear in unbiased)
            and hasattr(rotary, "inv_freq") and getattr(rotary, "rope_type", "default") in ("default", "llama3"))


def _rotate_half_columns(weight_t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[in, heads * d]`` columns such that ``x @ result == rotate_half(x @ weight_t)`` per head."""
    heads = weight_t.reshape(*weight_t.shape[:-1], -1, head_dim)
    half = head_dim // 2
    return torch.cat((-heads[..., half:], heads[..., :half]), dim=-1).reshape(weight_t.shape)


def _share(linear: nn.Linear, weight_t: torch.Tensor) -> None:
    """Make ``linear``'s weight the transposed view of ``weight_t`` ``[in, out]`` (same values, no copy)."""
    linear.weight = nn.Parameter(weight_t.t(), requires_grad=False)


def _fold_rows(out_t: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``out_t`` ``[heads * d, hidden]`` with its rows in the order a folded attention's output lies in memory on
    CUDA: query head ``h = kv * group + g`` of token t sits at ``[t, g, kv]`` (``static_forward``'s folding), so
    the rows go ``(g, kv, d)`` where the model has them ``(kv, g, d)``. A copy (the model's own stays)."""
    heads = out_t.shape[0] // head_dim
    grouped = out_t.reshape(kv_heads, heads // kv_heads, head_dim, out_t.shape[1])
    return grouped.transpose(0, 1).reshape(out_t.shape).contiguous()


def _with_rotated(parts: tuple[torch.Tensor, ...], head_dim: int, rotated: bool) -> torch.Tensor:
    """q, k, v (``[..., width]`` weights or biases) side by side; with ``rotated``, then q and k with the rotary's
    rotate-half folded in (``_rotate_half_columns``) and zeros for v."""
    q, k, v = parts
    if rotated:
        parts = (q, k, v, _rotate_half_columns(q, head_dim), _rotate_half_columns(k, head_dim), torch.zeros_like(v))
    return torch.cat(parts, dim=-1).contiguous()


def _prepare_layer(layer: nn.Module, head_dim: int, fold_kv_heads: int = 0, rotated: bool = True) -> _Layer:
    """Fuse one layer's projections (see ``_Layer``); its ``nn.Linear`` weights become views of the result.
    ``fold_kv_heads``: the model's key/value heads when grouped heads are folded (``_fold_rows``), else 0;
    ``rotated``: the rotate-half columns folded in (without them, q/k/v only: the tree kernel rotates itself)."""
    attention, mlp = layer.self_attn, layer.mlp
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    q_t, k_t, v_t = (projection.weight.detach().t() for projection in projections)
    qkv = _with_rotated((q_t, k_t, v_t), head_dim, rotated)
    bias = None
    if attention.q_proj.bias is not None:
        bias = _with_rotated(tuple(projection.bias.detach() for projection in projections), head_dim, rotated)
    widths = (q_t.shape[1], k_t.shape[1], v_t.shape[1])
    for projection, start, width in zip((attention.q_proj, attention.k_proj, attention.v_proj),
                                        (0, widths[0], widths[0] + widths[1]), widths, strict=True):
        _share(projection, qkv[:, start : start + width])
    gate_up = torch.cat((mlp.gate_proj.weight.detach().t(), mlp.up_proj.weight.detach().t()), dim=1).contiguous()
    inner = mlp.gate_proj.out_features
    _share(mlp.gate_proj, gate_up[:, :inner])
    _share(mlp.up_proj, gate_up[:, inner:])
    out = attention.o_proj.weight.detach().t()
    if fold_kv_heads:
        out = _fold_rows(out, fold_kv_heads, head_dim)
    return _Layer(layer.input_layernorm.weight.detach(), qkv, bias, out,
                  layer.post_attention_layernorm.weight.detach(), gate_up, mlp.down_proj.weight.detach().t())


def prepare_weights(model: PreTrainedModel, path: str | None = None, tree_kernel: bool | None = None) -> StaticWeights:
    """``model``'s weights laid out for ``static_forward`` (``supports(model)`` must hold). The q/k/v and
    gate/up ``nn.Linear`` weights are re-pointed at views of the fused matrices: one copy of the model stays.

    ``path`` is the device type whose code path the forward takes (default: the model's). ``"cuda"`` on a CPU
    model rehearses CUDA's: grouped query heads folded into the query length, and attention outputs with the
    strides CUDA's flash and memory-efficient kernels give them (``[B, H, T, d]`` over ``[B, T, H, d]`` memory),
    so that a shape or stride assumption of the CUDA path fails on the CPU first. Folded, the output projection's
    rows are a permuted copy (``_fold_rows``): the attention's output then feeds it as a view, with no copy.

    ``tree_kernel`` (default: on CUDA's path, where ``decoding.forward.tree_attention`` takes the head size and, on
    a GPU, Triton is installed; a rehearsal decides as the GPU would): each layer's attention is that one op (its
    rotary, key/value write and attention in one kernel on a GPU), over q/k/v without the rotate-half columns and
    without folding."""
    path = path or model.device.type
    config = model.config.get_text_config(decoder=True)
    decoder = model.model
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = decoder.layers[0].self_attn.head_dim
    if tree_kernel is None:
        tree_kernel = path == "cuda" and eligible(head_dim) and (model.device.type != "cuda" or triton_available())
    fold_groups = path == "cuda" and heads > kv_heads and not tree_kernel
    layers = tuple(_prepare_layer(layer, head_dim, kv_heads if fold_groups else 0, rotated=not tree_kernel)
                   for layer in decoder.layers[: config.num_hidden_layers])
    rotary = decoder.rotary_emb
    return StaticWeights(
        embed=decoder.embed_tokens.weight.detach(),
        layers=layers,
        norm=decoder.norm.weight.detach(),
        head=model.lm_head.weight.detach().t(),
        inv_freq=rotary.inv_freq.detach().float(),
        rope_scale=float(getattr(rotary, "attention_scaling", 1.0)),
        eps=float(decoder.norm.variance_epsilon),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        scaling=float(decoder.layers[0].self_attn.scaling),
        fold_groups=fold_groups,
        cuda_layout=path == "cuda" and model.device.type != "cuda",
        unrotated=torch.tensor([1.0, 0.0], dtype=model.dtype, device=model.device).view(1, 2, 1, 1).expand(
            1, 2, 1, head_dim).contiguous(),
        kv_columns=torch.arange(2 * kv_heads, device=model.device),
        tree_kernel=tree_kernel,
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: one fused op where torch has it (``F.rms_norm`` is six on the CPU)."""
    if _FUSED_RMS_NORM:
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


_FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm")  # decoding.forward.private_api lists it


def _rotary_table(weights: StaticWeights, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, 2, d]``: each token's cos (index 0) and sin (1), the rotary's scaling folded in."""
    freqs = positions.unsqueeze(1).float() * weights.inv_freq  # [n, d/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [n, d]
    table = torch.stack((angles.cos(), angles.sin()), dim=1)  # [n, 2, d]
    if weights.rope_scale != 1.0:
        table = table * weights.rope_scale
    return table if table.dtype == dtype else table.to(dtype)


def _rotation(weights: StaticWeights, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, 2, heads + 2 kv, d]``: each token's cos (index 0) and sin (1) for q and k heads, and (1, 0) for v
    heads, so that ``(states.view(n, 2, heads_total, d) * rotation).sum(1)`` is rotary applied to q and k."""
    table = _rotary_table(weights, positions, dtype)
    count = positions.shape[0]
    rotated = table.unsqueeze(2).expand(count, 2, weights.heads + weights.kv_heads, weights.head_dim)
    return torch.cat((rotated, weights.unrotated.expand(count, 2, weights.kv_heads, weights.head_dim)), dim=2)


def _attention_mask(
    parents: torch.Tensor, lengths: torch.Tensor, attended: int, dtype: torch.dtype, depth: int | None = None
) -> torch.Tensor:
    """The additive ``[B, 1, T, attended]`` mask: cache slot s is seen by every token when ``s < length``, and
    by token i when ``s = length + j`` for j an ancestor of i (or i itself); every other slot is masked."""
    return mask_from_reach(ancestors(parents, dtype, depth), lengths, attended, dtype)


def static_forward(
    weights: StaticWeights, caches: Sequence[torch.Tensor], inputs: torch.Tensor, sequences: int, tokens: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None, top_k: int = 0, depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One static step. ``caches[l]``: layer l's pool view ``[rows, 2 kv, attended, d]``; ``inputs``: the int64
    buffer (module contract) for ``sequences`` x ``tokens``. Returns the logits ``[B, T, vocab]`` of the rows
    read (``read_rows``, flat indices into the step's tokens) and their ids ``[B, 1 + top_k, T]`` (``row_ids``),
    written into ``out`` when it is given (``[B * T, vocab]`` and ``[B, 1 + top_k, T]``: the bucket's views of
    buffers shared by every bucket)."""
    count = sequences * tokens
    sizes = [count] * len(TOKEN_FIELDS) + [sequences] * len(SEQUENCE_FIELDS)
    token_ids, positions, parents, read_rows, lengths, rows = inputs.split(sizes)
    dtype = weights.embed.dtype
    hidden = F.embedding(token_ids, weights.embed)  # [n, hidden]
    if weights.tree_kernel:
        table = _rotary_table(weights, positions, dtype)
        reach = tree_reach(parents.view(sequences, tokens))
        for layer, cache in zip(weights.layers, caches, strict=True):
            states = _qkv(layer, _rms_norm(hidden, layer.input_norm, weights.eps))
            attended = tree_attention(states, table, cache, reach, lengths, rows, weights.heads, weights.scaling)
            hidden = _mlp_block(weights, layer, torch.addmm(hidden, attended, layer.out))
        return _read(weights, hidden, read_rows, sequences, tokens, top_k, out)
    rotation = _rotation(weights, positions, dtype)
    mask = _attention_mask(parents.view(sequences, tokens), lengths, caches[0].shape[2], dtype, depth)
    group = weights.heads // weights.kv_heads
    if weights.fold_groups:  # query rows (token, group): each token's row repeated for its group's heads
        mask = mask.unsqueeze(3).expand(-1, -1, -1, group, -1).reshape(sequences, 1, tokens * group, -1)
    write_rows = rows.unsqueeze(1).expand(sequences, tokens).reshape(count, 1)  # [n, 1]
    write_slots = (lengths.unsqueeze(1) + torch.arange(tokens, device=lengths.device)).view(count, 1)  # [n, 1]
    destination = (write_rows, weights.kv_columns, write_slots)  # [n, 1], [2 kv], [n, 1]
    for layer, cache in zip(weights.layers, caches, strict=True):
        hidden = _mlp_block(weights, layer, _attention_block(weights, layer, cache, hidden, rotation, mask,
                                                             destination, rows, sequences))
    return _read(weights, hidden, read_rows, sequences, tokens, top_k, out)


def _qkv(layer: _Layer, normed: torch.Tensor) -> torch.Tensor:
    """The layer's fused q/k/v projection of ``normed`` ``[n, hidden]``."""
    if layer.qkv_bias is None:
        return torch.mm(normed, layer.qkv)
    return torch.addmm(layer.qkv_bias, normed, layer.qkv)


def _mlp_block(weights: StaticWeights, layer: _Layer, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden + down(silu(gate) * up)`` of the post-attention norm of ``hidden`` ``[n, hidden]``."""
    normed = _rms_norm(hidden, layer.post_norm, weights.eps)
    gate, up = torch.mm(normed, layer.gate_up).split(layer.down.shape[0], dim=1)
    return torch.addmm(hidden, F.silu(gate) * up, layer.down)


def _read(
    weights: StaticWeights, hidden: torch.Tensor, read_rows: torch.Tensor, sequences: int, tokens: int, top_k: int,
    out: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the rows read and their ids (``static_forward``'s return)."""
    read = _rms_norm(hidden.index_select(0, read_rows), weights.norm, weights.eps)
    logits = torch.mm(read, weights.head, out=None if out is None else out[0]).view(sequences, tokens, -1)
    return logits, row_ids(logits, top_k, None if out is None else out[1])


def row_ids(logits: torch.Tensor, top_k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, 1 + top_k, T]`` ids of the rows of ``logits`` ``[B, T, vocab]``: index 0 each row's argmax (the first
    maximum, as ``decoding.forward.choice.greedy_ids``), then its ``top_k`` best ids, best first (the device's order
    among equal scores: guesses only). One buffer, so that the host reads every id a step needs in one copy; laid out by
    column, so that a row's argmax ids are one list and its top ids ``zip`` into rows (``decoding.forward.choice``).
    Written into ``out`` when given. Five ATen ops (argmax, top-k, their copy into one buffer), two without ``top_k``.

    >>> row_ids(torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]]]), 2).tolist()
    [[[1, 0], [1, 0], [2, 2]]]
    """
    if not top_k:
        if out is None:
            return logits.argmax(dim=-1).unsqueeze(1)
        torch.argmax(logits, dim=-1, out=out.squeeze(1))
        return out
    argmax = logits.argmax(dim=-1).unsqueeze(1)  # [B, 1, T]
    top = logits.topk(top_k, dim=-1).indices.transpose(1, 2)  # [B, k, T]
    return torch.cat((argmax, top), dim=1, out=out)


def _attention_block(
    weights: StaticWeights, layer: _Layer, cache: torch.Tensor, hidden: torch.Tensor, rotation: torch.Tensor,
    mask: torch.Tensor, destination: tuple[torch.Tensor, ...], rows: torch.Tensor, sequences: int,
) -> torch.Tensor:
    """``hidden + o(attention(norm(hidden)))`` for ``[n, hidden]``; writes the step's keys/values into ``cache``."""
    count, heads, kv_heads, dim = hidden.shape[0], weights.heads, weights.kv_heads, weights.head_dim
    states = _qkv(layer, _rms_norm(hidden, layer.input_norm, weights.eps))
    states = (states.view(count, 2, heads + 2 * kv_heads, dim) * rotation).sum(1)  # rotary on q, k
    query, new = states.split((heads, 2 * kv_heads), dim=1)
    cache.index_put_(destination, new)  # token i's keys and values at (its row, every KV head, its slot)
    keys, values = cache.index_select(0, rows).split(kv_heads, dim=1)  # [B, kv, L, d] each
    tokens, group = count // sequences, heads // kv_heads
    if weights.fold_groups:  # [B, kv, T * group, d]: query head kv * group + g of token t at row t * group + g
        folded = query.view(sequences, tokens, kv_heads, group, dim).transpose(1, 2)
        output = _attend(weights, folded.reshape(sequences, kv_heads, tokens * group, dim), keys, values, mask,
                         gqa=False)  # CUDA's memory: [B, T * group, kv, d], the order of ``layer.out``'s rows
    else:
        query = query.view(sequences, tokens, heads, dim).transpose(1, 2)  # [B, heads, T, d]
        output = _attend(weights, query, keys, values, mask, gqa=kv_heads != heads)
    return torch.addmm(hidden, output.transpose(1, 2).reshape(count, heads * dim), layer.out)


def _attend(
    weights: StaticWeights, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
    gqa: bool,
) -> torch.Tensor:
    """Scaled dot-product attention ``[B, H, T, d]``; in a rehearsal (``cuda_layout``) its output is given the
    strides of CUDA's flash and memory-efficient kernels (heads inside tokens in memory), same values."""
    output = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=weights.scaling,
                                            enable_gqa=gqa)
    if weights.cuda_layout:
        output = output.transpose(1, 2).contiguous().transpose(1, 2)
    return output


def fresh_forward() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A copy of ``static_forward`` with a code object of its own, so that ``torch.compile`` keeps one cache
    entry (one graph) per copy: one copy per bucket, never a recompile."""
    code = static_forward.__code__.replace()
    return types.FunctionType(code, static_forward.__globals__, static_forward.__name__, static_forward.__defaults__,
                              static_forward.__closure__)
