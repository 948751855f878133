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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel

from decoding.kv_cache import SlotCache

PACKED_ATTENTION = "lookahead_packed"


@dataclass(frozen=True)
class Slice:
    """One sequence's part of a packed forward.

    - ``tokens``: the step's input token ids (``t`` of them).
    - ``positions`` ``[t]``: their absolute position ids.
    - ``visible`` ``[t, t]`` bool, or None for causal: which step tokens each step token attends to (every
      step token also sees the whole cache).
    - ``logit_rows`` ``[r]``: the step rows whose logits are returned (may be empty).
    - ``cache``: the sequence's cache; the forward appends ``t`` slots to it.
    """

    tokens: list[int]
    positions: torch.Tensor
    visible: torch.Tensor | None
    logit_rows: torch.Tensor
    cache: SlotCache


@dataclass(frozen=True)
class _Part:
    """Where a slice sits in the packed row, and its attention mask (None: plain causal over an empty cache)."""

    start: int
    end: int
    cache: SlotCache
    mask: torch.Tensor | None


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
    """Attention for a packed forward: each slice's queries over its own cache. Returns ``[1, T, heads, dim]``."""
    if packed is None:
        raise RuntimeError(f"the {PACKED_ATTENTION!r} attention runs only inside decoding.packed.forward_packed")
    outputs = []
    for part, keys, values in packed.update(module.layer_idx, key, value):
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, part.start : part.end],
                keys,
                values,
                attn_mask=part.mask,
                is_causal=part.mask is None,
                scale=scaling,
                enable_gqa=True,
            )
        )
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return output.transpose(1, 2), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)

# A 4-D attention mask is passed through untouched by transformers' mask builders; the real masks are per slice.
_NO_MASK = torch.zeros((1, 1, 1, 1))


def _mask(slice_: Slice, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The additive ``[1, 1, t, past + t]`` mask of one slice; None when causal over an empty cache."""
    count = len(slice_.tokens)
    if slice_.visible is None and past == 0:
        return None
    visible = slice_.visible
    if visible is None:
        visible = torch.ones((count, count), dtype=torch.bool).tril_()
    mask = torch.zeros((1, 1, count, past + count), dtype=dtype)
    mask[0, 0, :, past:].masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.to(device)


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


def forward_packed(model: PreTrainedModel, slices: Sequence[Slice]) -> list[torch.Tensor]:
    """Run one forward over every slice; return each slice's logits ``[len(logit_rows), vocab]`` in order.

    Each slice's cache grows by its token count. Raises ``CacheOverflowError`` if a cache would overflow.
    """
    device = model.device
    parts, tokens, positions, rows, start = [], [], [], [], 0
    for slice_ in slices:
        end = start + len(slice_.tokens)
        parts.append(_Part(start, end, slice_.cache, _mask(slice_, slice_.cache.length, model.dtype, device)))
        tokens.extend(slice_.tokens)
        positions.append(slice_.positions)
        rows.append(slice_.logit_rows + start)
        start = end
    with _packed_attention_selected(model):
        logits = model(
            input_ids=torch.tensor([tokens], device=device),
            position_ids=torch.cat(positions).unsqueeze(0).to(device),
            attention_mask=_NO_MASK,
            use_cache=False,
            logits_to_keep=torch.cat(rows).to(device),
            packed=PackedBatch(parts),
        ).logits[0]
    return list(torch.split(logits, [len(slice_.logit_rows) for slice_ in slices]))
