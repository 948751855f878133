"""One forward pass over the step tokens of several sequences, each attending only to its own KV cache.

Contract: ``forward_packed(model, slices)`` concatenates the slices' tokens into one row ``[1, T]``, so every
embedding, projection, MLP and the LM head run once over all ``T`` tokens. Attention runs per slice: the
slice's new keys/values are written into its own ``SlotCache`` at that cache's length (in place), and its
queries attend to that cache, the committed prefix fully and the step's own tokens as ``visible`` says.
It returns each slice's kept logits. Nothing is padded and no cache is copied, so sequences of any lengths,
each with its own step shape, share a forward; a slice's result does not depend on the other slices except
through floating-point kernel choices (the same ones that make a multi-token step differ from a
one-token step).

The model must be a transformers causal LM whose attention layers dispatch through ``AttentionInterface``
(LLaMA, Qwen2, Mistral, ...): this module registers the ``lookahead_packed`` attention function and selects
it only for the duration of a packed forward.

On CUDA the forward keeps cuDNN's attention out: cuDNN builds an execution plan for every new pair of query
and key lengths, and a decode changes them on every step (measured on an H100: 2.2 ms of CPU per attention
call, 64% of a step). A masked slice's grouped query heads are folded into its query length instead
(``[1, heads, t, d]`` -> ``[1, kv_heads, group * t, d]``, the mask repeated per group), so the memory-efficient
kernel attends each KV head once without copying the cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PreTrainedModel

from decoding.forward import fused, lean
from decoding.forward.kv_cache import SlotCache
from decoding.forward.slices import Slice

PACKED_ATTENTION = "lookahead_packed"
# A model attribute naming the function that steps it in place of ``lean.forward`` (``decoding.forward.compiled``).
LEAN_FORWARD = "_lookahead_lean_forward"
# Attention kernels of a packed forward on CUDA (no cuDNN: see the module docstring).
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class _Part:
    """Where a slice sits in the packed row, and its attention mask (None: plain causal over an empty cache).

    With ``group`` > 1 the mask is already repeated for that many query heads per KV head (``[1, 1, group * t,
    past + t]``) and the slice's attention runs with its grouped heads folded into the query length.
    """

    start: int
    end: int
    cache: SlotCache
    mask: torch.Tensor | None
    group: int = 1


class PackedBatch:
    """The per-slice routing a packed forward hands to every attention layer (the ``packed`` keyword)."""

    def __init__(self, parts: Sequence[_Part]) -> None:
        self.parts = list(parts)

    def update(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> Iterator[tuple[_Part, torch.Tensor, torch.Tensor]]:
        """Write each slice's new ``[1, heads, t, dim]`` keys/values into its cache; yield its full keys/values."""
        for part in self.parts:
            layer = part.cache.layers[layer_idx]
            cached_keys, cached_values = layer.update(
                keys[:, :, part.start : part.end], values[:, :, part.start : part.end]
            )
            yield part, cached_keys, cached_values

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """Layer ``layer_idx``'s attention: store each slice's new keys/values, attend each slice's queries over
        its own cache. ``[1, heads, T, dim]`` queries in, ``[1, T, heads, dim]`` out."""
        outputs = []
        for part, keys, values in self.update(layer_idx, key, value):
            queries = query[:, :, part.start : part.end]
            if part.group > 1 and part.mask is not None:
                outputs.append(_folded_attention(queries, keys, values, part.mask, part.group, scaling))
                continue
            outputs.append(
                torch.nn.functional.scaled_dot_product_attention(
                    queries,
                    keys,
                    values,
                    attn_mask=part.mask,
                    is_causal=part.mask is None,
                    scale=scaling,
                    enable_gqa=True,
                )
            )
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
        return output.transpose(1, 2)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packed: PackedBatch | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over ``PackedBatch.attend``. Returns ``[1, T, heads, dim]``."""
    if packed is None:
        raise RuntimeError(
            f"the {PACKED_ATTENTION!r} attention runs only inside decoding.forward.packed.forward_packed")
    return packed.attend(module.layer_idx, query, key, value, scaling), None


def _folded_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, group: int, scaling: float | None
) -> torch.Tensor:
    """Grouped-query attention as plain attention over the KV heads: ``query`` ``[1, kv * group, t, d]`` becomes
    ``[1, kv, group * t, d]`` (query head h uses KV head h // group, as transformers' ``repeat_kv``), attends
    under ``mask`` ``[1, 1, group * t, s]``, and is unfolded back to ``[1, kv * group, t, d]``."""
    _, heads, count, dim = query.shape
    kv_heads = heads // group
    folded = query.reshape(1, kv_heads, group * count, dim)
    output = torch.nn.functional.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scaling)
    return output.reshape(1, heads, count, dim)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)

# A 4-D attention mask is passed through untouched by transformers' mask builders; the real masks are per slice.
_NO_MASK = torch.zeros((1, 1, 1, 1))


def _mask(slice_: Slice, past: int, dtype: torch.dtype, device: torch.device, group: int = 1) -> torch.Tensor | None:
    """The additive ``[1, 1, group * t, past + t]`` mask of one slice (its ``[t, past + t]`` rows repeated
    ``group`` times); None when causal over an empty cache."""
    count = len(slice_.tokens)
    visible = slice_.visible_mask()
    if visible is None and past == 0:
        return None
    if visible is None:
        visible = torch.ones((count, count), dtype=torch.bool).tril_()
    # Built where it is used: only the [t, t] booleans cross to the device, not the [t, past + t] floats.
    mask = torch.zeros((1, 1, count, past + count), dtype=dtype, device=device)
    mask[0, 0, :, past:].masked_fill_(~visible.to(device), torch.finfo(dtype).min)
    return mask.repeat(1, 1, group, 1) if group > 1 else mask


def query_group(model: PreTrainedModel) -> int:
    """How many query heads share one KV head in ``model`` (1 without grouped-query attention)."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    return heads // (getattr(config, "num_key_value_heads", None) or heads)


@contextmanager
def _packed_attention_selected(model: PreTrainedModel) -> Iterator[None]:
    """Select the packed attention function on ``model`` for the duration of the block."""
    configs = {id(model.config): model.config}
    text_config = model.config.get_text_config(decoder=True)
    configs[id(text_config)] = text_config
    saved = [(config, getattr(config, "_attn_implementation_internal", None)) for config in configs.values()]
    for config, _ in saved:
        config._attn_implementation_internal = PACKED_ATTENTION
    try:
        yield
    finally:
        for config, previous in saved:
            config._attn_implementation_internal = previous


@contextmanager
def _attention_kernels(device: torch.device) -> Iterator[None]:
    """On CUDA, restrict scaled-dot-product attention to ``CUDA_BACKENDS`` for the block; elsewhere nothing."""
    if device.type != "cuda":
        yield
        return
    with sdpa_kernel(CUDA_BACKENDS):
        yield


def forward_packed(model: PreTrainedModel, slices: Sequence[Slice]) -> list[torch.Tensor]:
    """Run one forward over every slice; return each slice's logits ``[len(logit_rows), vocab]`` in order.

    Each slice's cache grows by its token count. Raises ``CacheOverflowError`` if a cache would overflow. A
    LLaMA-family model on native CPU kernels takes the fused step (``decoding.forward.fused``: its small operations in
    native calls) unless its ``LEAN_FORWARD`` attribute names a forward (``decoding.forward.compiled``, for the A/B of
    ``python -m bench compile``); another LLaMA-family model is stepped by ``decoding.forward.lean`` (the same logits as
    its public forward, less framework work per step); any other goes through its public forward with the packed
    attention function selected.
    """
    plan = None if hasattr(model, LEAN_FORWARD) else fused.plan_for(model)
    if plan is not None:
        return plan.forward(slices)
    device = model.device
    group = query_group(model) if device.type == "cuda" else 1
    parts, tokens, positions, rows, start = [], [], [], [], 0
    for slice_ in slices:
        if slice_.cache.pool is not None:
            slice_.cache.pool.flush()  # a pool row's deferred commits land before its keys are read
        end = start + len(slice_.tokens)
        mask = _mask(slice_, slice_.cache.length, model.dtype, device, group)
        parts.append(_Part(start, end, slice_.cache, mask, group))
        tokens.extend(slice_.tokens)
        positions.append(slice_.position_tensor())
        rows.append(slice_.row_tensor() + start)
        start = end
    batch = PackedBatch(parts)
    input_ids = torch.tensor(tokens, device=device)
    position_ids, kept = torch.cat(positions).to(device), torch.cat(rows).to(device)
    with _attention_kernels(device):
        if lean.supports(model):
            forward = getattr(model, LEAN_FORWARD, lean.forward)
            logits = forward(model, input_ids, position_ids, kept, batch.attend)
        else:
            logits = _public_forward(model, input_ids, position_ids, kept, batch)
    return list(torch.split(logits, [slice_.row_count for slice_ in slices]))


def _public_forward(
    model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor, batch: PackedBatch
) -> torch.Tensor:
    """``model``'s public forward over the packed row with the packed attention selected; logits of ``rows``."""
    with _packed_attention_selected(model):
        return model(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            attention_mask=_NO_MASK,
            use_cache=False,
            logits_to_keep=rows,
            packed=batch,
        ).logits[0]
