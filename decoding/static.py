"""The static step: one forward of fixed shapes over every running sequence, ready to be captured as a CUDA graph.

Contract: ``StaticStep(model, pool)`` runs the same forward as ``decoding.packed.forward_packed`` (a LLaMA-family
model, ``supports``) for slices whose caches are rows of ``pool`` (``decoding.kv_cache.KVPool``), padded up to a
``Bucket``: ``sequences`` x ``tokens`` input tokens attending over ``attended`` cache slots. ``run(slices)``
returns, per slice, the logits ``[len(logit_rows), vocab]`` of its ``logit_rows`` (a view of the bucket's output
buffer, valid until the next ``run``) and their argmax ids as Python ints; each slice's cache grows by its token
count, as in an eager forward. ``bucket(slices)`` says which bucket a step would run in (None: it does not fit,
run it eagerly).

Everything a step varies is data in one int64 input buffer, filled on the host and copied in one go: token ids,
positions, each token's parent in the step (the mask is the ancestor closure of the parents, built on the device
once per step), the rows to read, where each token's keys/values go (pool row, slot), each sequence's cache
length and pool row. Keys/values are written by index (``index_put_``) and read with one gather per layer;
attention runs over the bucket's attended length under an additive mask. Padding tokens of a real sequence are
written in the scratch slots past its tokens; padding sequences use the pool's scratch row. Padding tokens see
themselves (and their row's prefix), so no row is empty and no NaN arises; real tokens never see padding.

The forward itself (``static_forward``) is plain torch over fixed shapes: no Python value depends on the step's
data, no host sync, so ``torch.compile(fullgraph=True, dynamic=False)`` traces it into one graph per bucket and a
CUDA graph can capture it. Projections are fused (q/k/v with the rotary's rotate-half folded in as extra
columns, gate/up), norms use torch's fused RMSNorm, residual adds ride on ``addmm``: about 21 ATen ops a layer.
The modules' own weights become views of the fused ones, so the model is held once.

Modes: ``"eager"`` calls ``static_forward``; ``"compile"`` wraps one copy of it per bucket in ``torch.compile``
(one code object per bucket: one graph each, and no bucket evicts another from Dynamo's cache); ``"graphs"``
(CUDA) captures each bucket as a ``torch.cuda.CUDAGraph`` sharing one memory pool and replays it.
"""

from __future__ import annotations

import array
import functools
import logging
import math
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from decoding import lean
from decoding.kv_cache import KVPool
from decoding.packed import CUDA_BACKENDS, Slice

log = logging.getLogger(__name__)

SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)
MIN_ATTENDED = 64  # attended lengths: MIN_ATTENDED doubled until a pool row's capacity
MAX_BUCKET_TOKENS = 1024  # sequences x tokens of the largest bucket
MODES = ("eager", "compile", "graphs")
# The input buffer's fields, in order: six of ``sequences * tokens`` ints, then two of ``sequences``.
_TOKEN_FIELDS = ("token_ids", "positions", "parents", "read_rows", "write_rows", "write_slots")
_SEQUENCE_FIELDS = ("lengths", "rows")


@dataclass(frozen=True, order=True)
class Bucket:
    """A static step's shape: ``sequences`` x ``tokens`` input tokens, attending over ``attended`` cache slots."""

    sequences: int
    tokens: int
    attended: int

    @property
    def input_size(self) -> int:
        """Ints in the step's input buffer."""
        return len(_TOKEN_FIELDS) * self.sequences * self.tokens + len(_SEQUENCE_FIELDS) * self.sequences


def _round_up(value: int, choices: Sequence[int]) -> int | None:
    """The smallest of ``choices`` (ascending) that is at least ``value``; None when none is."""
    return next((choice for choice in choices if choice >= value), None)


def warm_buckets(static: StaticStep, longest: int = 1024) -> list[Bucket]:
    """The buckets a server builds at start: one sequence, every token bucket, attended lengths up to
    ``longest`` (the rest are built, or captured, on first use)."""
    attended = [length for length in static.attended if length <= longest] or [static.attended[0]]
    return [Bucket(1, tokens, length) for tokens in TOKEN_BUCKETS for length in attended]


def attended_lengths(row_capacity: int) -> tuple[int, ...]:
    """The attended-length buckets of a pool whose rows hold ``row_capacity`` slots.

    >>> attended_lengths(300)
    (64, 128, 256, 300)
    """
    lengths, length = [], MIN_ATTENDED
    while length < row_capacity:
        lengths.append(length)
        length *= 2
    return (*lengths, row_capacity)


# ---------------------------------------------------------------- weights


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
    fold_groups: bool  # fold grouped query heads into the query length (CUDA's memory-efficient kernel)
    unrotated: torch.Tensor  # [1, 2, 1, d]: cos 1, sin 0 (the v heads' "rotation"), on the device
    kv_columns: torch.Tensor  # arange(2 kv) on the device: the pool's key and value heads


def supports(model: PreTrainedModel) -> bool:
    """Whether ``StaticStep`` can run ``model``: a ``decoding.lean`` model with ``nn.Linear`` projections, SiLU
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


def _prepare_layer(layer: nn.Module, head_dim: int) -> _Layer:
    """Fuse one layer's projections (see ``_Layer``); its ``nn.Linear`` weights become views of the result."""
    attention, mlp = layer.self_attn, layer.mlp
    q_t, k_t, v_t = (projection.weight.detach().t() for projection in (attention.q_proj, attention.k_proj,
                                                                         attention.v_proj))
    qkv = torch.cat((q_t, k_t, v_t, _rotate_half_columns(q_t, head_dim), _rotate_half_columns(k_t, head_dim),
                     torch.zeros_like(v_t)), dim=1).contiguous()
    bias = None
    if attention.q_proj.bias is not None:
        q_b, k_b, v_b = (projection.bias.detach() for projection in (attention.q_proj, attention.k_proj,
                                                                      attention.v_proj))
        bias = torch.cat((q_b, k_b, v_b, _rotate_half_columns(q_b, head_dim), _rotate_half_columns(k_b, head_dim),
                          torch.zeros_like(v_b)))
    widths = (q_t.shape[1], k_t.shape[1], v_t.shape[1])
    for projection, start, width in zip((attention.q_proj, attention.k_proj, attention.v_proj),
                                        (0, widths[0], widths[0] + widths[1]), widths, strict=True):
        _share(projection, qkv[:, start : start + width])
    gate_up = torch.cat((mlp.gate_proj.weight.detach().t(), mlp.up_proj.weight.detach().t()), dim=1).contiguous()
    inner = mlp.gate_proj.out_features
    _share(mlp.gate_proj, gate_up[:, :inner])
    _share(mlp.up_proj, gate_up[:, inner:])
    return _Layer(layer.input_layernorm.weight.detach(), qkv, bias, attention.o_proj.weight.detach().t(),
                  layer.post_attention_layernorm.weight.detach(), gate_up, mlp.down_proj.weight.detach().t())


def prepare_weights(model: PreTrainedModel) -> StaticWeights:
    """``model``'s weights laid out for ``static_forward`` (``supports(model)`` must hold). The q/k/v and
    gate/up ``nn.Linear`` weights are re-pointed at views of the fused matrices: one copy of the model stays."""
    config = model.config.get_text_config(decoder=True)
    decoder = model.model
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = decoder.layers[0].self_attn.head_dim
    layers = tuple(_prepare_layer(layer, head_dim) for layer in decoder.layers[: config.num_hidden_layers])
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
        fold_groups=model.device.type == "cuda" and heads > kv_heads,
        unrotated=torch.tensor([1.0, 0.0], dtype=model.dtype, device=model.device).view(1, 2, 1, 1).expand(
            1, 2, 1, head_dim).contiguous(),
        kv_columns=torch.arange(2 * kv_heads, device=model.device),
    )


# ---------------------------------------------------------------- the forward


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: one fused op where torch has it (``F.rms_norm`` is six on the CPU)."""
    if _FUSED_RMS_NORM:
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


_FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm")  # decoding.private_api lists it


def _rotation(weights: StaticWeights, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, 2, heads + 2 kv, d]``: each token's cos (index 0) and sin (1) for q and k heads, and (1, 0) for v
    heads, so that ``(states.view(n, 2, heads_total, d) * rotation).sum(1)`` is rotary applied to q and k."""
    freqs = positions.unsqueeze(1).float() * weights.inv_freq  # [n, d/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [n, d]
    table = torch.stack((angles.cos(), angles.sin()), dim=1)  # [n, 2, d]
    if weights.rope_scale != 1.0:
        table = table * weights.rope_scale
    if table.dtype != dtype:
        table = table.to(dtype)
    count = positions.shape[0]
    rotated = table.unsqueeze(2).expand(count, 2, weights.heads + weights.kv_heads, weights.head_dim)
    return torch.cat((rotated, weights.unrotated.expand(count, 2, weights.kv_heads, weights.head_dim)), dim=2)


def _ancestors(parents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T, T]`` 0/1: entry ``[b, i, j]`` is 1 when step token ``j`` is ``i`` or an ancestor of ``i``
    (``parents[b, i]``: i's parent, -1 for none). Pointer doubling by squaring: ceil(log2(T - 1)) products."""
    count = parents.shape[1]
    columns = torch.arange(count, device=parents.device)
    linked = (parents.unsqueeze(-1) == columns) | torch.eye(count, dtype=torch.bool, device=parents.device)
    reach = linked.to(dtype)
    for _ in range(math.ceil(math.log2(count - 1)) if count > 2 else count - 1):
        reach = torch.bmm(reach, reach).clamp_max_(1)
    return reach


def _attention_mask(parents: torch.Tensor, lengths: torch.Tensor, attended: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``[B, 1, T, attended]`` mask: cache slot s is seen by every token when ``s < length``, and
    by token i when ``s = length + j`` for j an ancestor of i (or i itself); every other slot is masked."""
    count = parents.shape[1]
    reach = _ancestors(parents, dtype)  # [B, T, T]
    relative = torch.arange(attended, device=parents.device) - lengths.unsqueeze(1)  # [B, L]: slot - length
    in_step = reach.gather(2, relative.clamp(0, count - 1).unsqueeze(1).expand(-1, count, -1))  # [B, T, L]
    prefix = relative < 0
    step = (relative < count) & ~prefix
    seen = in_step * step.unsqueeze(1) + prefix.unsqueeze(1)
    return ((seen - 1) * torch.finfo(dtype).max).unsqueeze(1)


def static_forward(
    weights: StaticWeights, caches: Sequence[torch.Tensor], inputs: torch.Tensor, sequences: int, tokens: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One static step. ``caches[l]``: layer l's pool view ``[rows, 2 kv, attended, d]``; ``inputs``: the int64
    buffer (module contract) for ``sequences`` x ``tokens``. Returns the logits ``[B, T, vocab]`` of the rows
    read (``read_rows``, flat indices into the step's tokens) and their argmax ``[B, T]``, written into the
    front of ``out`` (``[rows, vocab]`` and ``[rows]`` buffers shared by every bucket) when it is given."""
    count = sequences * tokens
    sizes = [count] * len(_TOKEN_FIELDS) + [sequences] * len(_SEQUENCE_FIELDS)
    token_ids, positions, parents, read_rows, write_rows, write_slots, lengths, rows = inputs.split(sizes)
    dtype = weights.embed.dtype
    hidden = F.embedding(token_ids, weights.embed)  # [n, hidden]
    rotation = _rotation(weights, positions, dtype)
    mask = _attention_mask(parents.view(sequences, tokens), lengths, caches[0].shape[2], dtype)
    group = weights.heads // weights.kv_heads
    if weights.fold_groups:
        mask = mask.repeat(1, 1, group, 1)
    destination = (write_rows.unsqueeze(1), weights.kv_columns, write_slots.unsqueeze(1))  # [n, 1], [2 kv], [n, 1]
    for layer, cache in zip(weights.layers, caches, strict=True):
        hidden = _attention_block(weights, layer, cache, hidden, rotation, mask, destination, rows, sequences)
        normed = _rms_norm(hidden, layer.post_norm, weights.eps)
        gate, up = torch.mm(normed, layer.gate_up).split(layer.down.shape[0], dim=1)
        hidden = torch.addmm(hidden, F.silu(gate) * up, layer.down)
    read = _rms_norm(hidden.index_select(0, read_rows), weights.norm, weights.eps)
    if out is None:
        logits = torch.mm(read, weights.head).view(sequences, tokens, -1)
        return logits, logits.argmax(dim=-1)
    logits, argmax = out[0][:count], out[1][:count]
    torch.mm(read, weights.head, out=logits)
    torch.argmax(logits, dim=-1, out=argmax)
    return logits.view(sequences, tokens, -1), argmax.view(sequences, tokens)


def _attention_block(
    weights: StaticWeights, layer: _Layer, cache: torch.Tensor, hidden: torch.Tensor, rotation: torch.Tensor,
    mask: torch.Tensor, destination: tuple[torch.Tensor, ...], rows: torch.Tensor, sequences: int,
) -> torch.Tensor:
    """``hidden + o(attention(norm(hidden)))`` for ``[n, hidden]``; writes the step's keys/values into ``cache``."""
    count, heads, kv_heads, dim = hidden.shape[0], weights.heads, weights.kv_heads, weights.head_dim
    normed = _rms_norm(hidden, layer.input_norm, weights.eps)
    if layer.qkv_bias is None:
        states = torch.mm(normed, layer.qkv)
    else:
        states = torch.addmm(layer.qkv_bias, normed, layer.qkv)
    states = (states.view(count, 2, heads + 2 * kv_heads, dim) * rotation).sum(1)  # rotary on q, k
    query, new = states.split((heads, 2 * kv_heads), dim=1)
    cache.index_put_(destination, new)  # token i's keys and values at (its row, every KV head, its slot)
    keys, values = cache.index_select(0, rows).split(kv_heads, dim=1)  # [B, kv, L, d] each
    tokens = count // sequences
    query = query.view(sequences, tokens, heads, dim).transpose(1, 2)  # [B, heads, T, d]
    if weights.fold_groups:
        folded = query.reshape(sequences, kv_heads, (heads // kv_heads) * tokens, dim)
        output = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=weights.scaling)
        output = output.view(sequences, heads, tokens, dim)
    else:
        output = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=weights.scaling,
                                                enable_gqa=kv_heads != heads)
    return torch.addmm(hidden, output.transpose(1, 2).reshape(count, heads * dim), layer.out)


def fresh_forward() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A copy of ``static_forward`` with a code object of its own, so that ``torch.compile`` keeps one cache
    entry (one graph) per copy: one copy per bucket, never a recompile."""
    code = static_forward.__code__.replace()
    return types.FunctionType(code, static_forward.__globals__, static_forward.__name__, static_forward.__defaults__,
                              static_forward.__closure__)


# ---------------------------------------------------------------- the runner


class _Compiled:
    """One bucket's device buffers and callable (eager, compiled, or a replayed CUDA graph)."""

    def __init__(self, bucket: Bucket, device: torch.device, pinned: bool) -> None:
        self.bucket = bucket
        self.host = torch.zeros(bucket.input_size, dtype=torch.long, pin_memory=pinned)
        self.inputs = torch.zeros(bucket.input_size, dtype=torch.long, device=device)
        self.run: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None


class StaticStep:
    """Runs steps whose slices fit a bucket through ``static_forward`` (module contract).

    ``mode``: one of ``MODES``; ``"graphs"`` needs CUDA. ``backend`` is ``torch.compile``'s in ``"compile"`` mode.
    ``runs`` counts the steps it ran, ``eager`` the steps its caller ran eagerly because they fit no bucket
    (``decoding.batch.forward_batch`` counts them), ``replays`` and ``captures`` the graph replays and captures
    (``capture_seconds`` their total time).
    """

    def __init__(
        self, model: PreTrainedModel, pool: KVPool, mode: str = "eager", backend: str | Callable = "inductor",
        max_bucket_tokens: int = MAX_BUCKET_TOKENS,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "graphs" and pool.storage.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and its KV pool on a CUDA device")
        if not supports(model):
            raise ValueError(f"the static step cannot run a {type(model).__name__}")
        self.model, self.pool, self.mode, self.backend = model, pool, mode, backend
        self.weights = prepare_weights(model)
        self.device = pool.storage.device
        self.max_bucket_tokens = max_bucket_tokens
        self.attended = attended_lengths(pool.row_capacity)
        self.runs = self.eager = self.replays = self.captures = 0
        self.capture_seconds = 0.0
        self._buckets: dict[Bucket, _Compiled] = {}
        self._graph_pool = None
        self._output_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._attended_views: dict[int, tuple[torch.Tensor, ...]] = {}

    def bucket(self, slices: Sequence[Slice]) -> Bucket | None:
        """The bucket ``slices`` run in, or None when they do not fit one (run them eagerly)."""
        sequences = _round_up(len(slices), [b for b in SEQUENCE_BUCKETS if b <= self.pool.sequences])
        widest = max(max(len(slice_.tokens), slice_.row_count) for slice_ in slices)  # rows may repeat
        tokens = _round_up(widest, TOKEN_BUCKETS)
        if sequences is None or tokens is None or sequences * tokens > self.max_bucket_tokens:
            return None
        reach = 0
        for slice_ in slices:
            masked = slice_.visible is not None or slice_.visibility is not None
            if slice_.cache.pool_row is None or (masked and slice_.parents is None):
                return None
            reach = max(reach, slice_.cache.length + tokens)
        attended = _round_up(reach, self.attended)
        return None if attended is None else Bucket(sequences, tokens, attended)

    def run(self, slices: Sequence[Slice], bucket: Bucket | None = None) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Run ``slices`` (they must fit: ``bucket(slices)`` is not None); see the module contract."""
        compiled = self.prepare(slices, bucket)
        return self.collect(slices, *self.launch(compiled))

    def prepare(self, slices: Sequence[Slice], bucket: Bucket | None = None) -> _Compiled:
        """Apply the pool's deferred commits, fill the bucket's inputs for ``slices`` and start their copy to
        the device (no wait); return the bucket, ready to ``launch``."""
        bucket = bucket or self.bucket(slices)
        if bucket is None:
            raise ValueError("these slices fit no static bucket")
        self.pool.flush()
        compiled = self._compiled(bucket)
        self._fill(compiled.host, slices, bucket)
        compiled.inputs.copy_(compiled.host, non_blocking=True)
        return compiled

    def launch(self, compiled: _Compiled) -> tuple[torch.Tensor, torch.Tensor]:
        """Run (or replay) the prepared bucket: its logits ``[B, T, vocab]`` and argmax ``[B, T]`` buffers."""
        self.runs += 1
        return compiled.run()

    def collect(
        self, slices: Sequence[Slice], logits: torch.Tensor, argmax: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Read the step's argmax ids (its one device-to-host copy), grow each slice's cache by its tokens, and
        split the outputs per slice."""
        ids = argmax.tolist()
        results, predicted = [], []
        for index, slice_ in enumerate(slices):
            rows = slice_.row_count
            results.append(logits[index, :rows])
            predicted.append(ids[index][:rows])
            slice_.cache.advance(len(slice_.tokens))
        return results, predicted

    def _fill(self, host: torch.Tensor, slices: Sequence[Slice], bucket: Bucket) -> None:
        """Write the step's inputs (module contract) into the host buffer, from Python ints in one copy (a slice
        without ``host_positions`` / ``host_rows`` has its tensors read instead)."""
        tokens = bucket.tokens
        fields: list[list[int]] = [[] for _ in _TOKEN_FIELDS]
        ids, positions, parents, read_rows, write_rows, write_slots = fields
        lengths: list[int] = []
        rows: list[int] = []
        for index in range(bucket.sequences):
            slice_ = slices[index] if index < len(slices) else None
            base = index * tokens
            if slice_ is None:  # a padding sequence: the scratch row, nothing cached
                real, length, row, read = 0, 0, self.pool.scratch_row, ()
            else:
                real, length, row = len(slice_.tokens), slice_.cache.length, slice_.cache.pool_row
                ids += slice_.tokens
                positions += slice_.host_positions if slice_.host_positions is not None else slice_.positions.tolist()
                parents += slice_.parents if slice_.parents is not None else range(-1, real - 1)
                read = slice_.host_rows if slice_.host_rows is not None else slice_.logit_rows.tolist()
            pad = tokens - real
            ids += [0] * pad
            positions += [length + real] * pad  # padding: past the sequence, any finite value
            parents += [-1] * pad
            read_rows += [base + r for r in read]
            read_rows += [base] * (tokens - len(read))
            write_rows += [row] * tokens
            write_slots += range(length, length + tokens)
            lengths.append(length)
            rows.append(row)
        values = array.array("q")  # 8-byte ints: ~10x faster into a tensor than torch.tensor(list)
        for field in (*fields, lengths, rows):
            values.extend(field)
        host.copy_(torch.frombuffer(values, dtype=torch.long))

    def _compiled(self, bucket: Bucket) -> _Compiled:
        """The bucket's buffers and callable, built (and in ``"graphs"`` mode captured) on first use."""
        compiled = self._buckets.get(bucket)
        if compiled is not None:
            return compiled
        compiled = _Compiled(bucket, self.device, pinned=self.device.type == "cuda")
        caches = self._views(bucket.attended)
        if self.mode == "compile":
            function = torch.compile(fresh_forward(), fullgraph=True, dynamic=False, backend=self.backend)
        else:
            function = static_forward
        call = functools.partial(function, self.weights, caches, compiled.inputs, bucket.sequences, bucket.tokens)
        if self.mode != "graphs":
            compiled.run = self._kernels(call)
        else:
            try:
                compiled.run = self._capture(functools.partial(call, self._outputs()), compiled)
            except Exception:  # a capture that fails must not take the server down: run eagerly from now on
                log.exception("CUDA graph capture of %s failed; the static step runs eagerly from now on", bucket)
                self.mode = "eager"
                compiled.run = self._kernels(call)
        self._buckets[bucket] = compiled
        return compiled

    def _kernels(self, call: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Callable:
        """``call`` run with ``decoding.packed``'s attention kernels on CUDA (no cuDNN), as is elsewhere."""
        if self.device.type != "cuda":
            return call

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            with torch.nn.attention.sdpa_kernel(CUDA_BACKENDS):
                return call()

        return run

    def _capture(self, call: Callable[[], tuple[torch.Tensor, torch.Tensor]], compiled: _Compiled) -> Callable:
        """Capture ``call`` as a CUDA graph (after warm-up runs on a side stream); return its replay."""
        started = time.perf_counter()
        run = self._kernels(call)
        # Warm-up writes the pool's scratch row only: the inputs are zeros (every token of sequence 0 at row 0
        # would clobber a real row, so point the rows at scratch first).
        self._point_at_scratch(compiled)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            outputs = run()
        torch.cuda.synchronize()
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        log.info("captured static bucket %s in %.1f ms", compiled.bucket, 1000 * (time.perf_counter() - started))

        def replay() -> tuple[torch.Tensor, torch.Tensor]:
            graph.replay()
            self.replays += 1
            return outputs

        return replay

    def _point_at_scratch(self, compiled: _Compiled) -> None:
        """Fill the bucket's device inputs with a step of padding sequences only (scratch row, no cache)."""
        bucket = compiled.bucket
        count = bucket.sequences * bucket.tokens
        host = torch.zeros(bucket.input_size, dtype=torch.long)
        parents_start, rows_field = 2 * count, 4 * count
        host[parents_start : parents_start + count] = -1
        host[rows_field : rows_field + count] = self.pool.scratch_row
        host[5 * count : 6 * count] = torch.arange(bucket.tokens).repeat(bucket.sequences)
        host[6 * count + bucket.sequences :] = self.pool.scratch_row
        compiled.inputs.copy_(host)

    def _outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and argmax buffers every captured bucket writes (one allocation, not one per graph)."""
        if self._output_buffers is None:
            vocab = self.weights.head.shape[1]
            rows = self.max_bucket_tokens
            self._output_buffers = (torch.empty((rows, vocab), dtype=self.weights.embed.dtype, device=self.device),
                                    torch.empty(rows, dtype=torch.long, device=self.device))
        return self._output_buffers

    def _views(self, attended: int) -> tuple[torch.Tensor, ...]:
        """Each layer's pool view cut to ``attended`` slots (made once per length)."""
        views = self._attended_views.get(attended)
        if views is None:
            views = self._attended_views[attended] = tuple(view[:, :, :attended] for view in self.pool.layer_views)
        return views

    def warm_up(self, buckets: Sequence[Bucket]) -> float:
        """Build (and capture) ``buckets`` now rather than on first use; return the seconds it took."""
        started = time.perf_counter()
        for bucket in buckets:
            self._compiled(bucket)
        return time.perf_counter() - started
