"""A preallocated KV cache written in place, with a one-call commit for multi-branch steps.

Contract: ``SlotCache`` is a transformers ``Cache`` whose layers hold ``[batch, heads, capacity, head_dim]``
buffers allocated once. A forward pass appends its keys/values at ``length`` (no concatenation, no copy of
the past); ``commit(keep, sources)`` keeps the first ``keep`` slots followed by the slots listed in
``sources`` and drops everything else. That is the whole KV fix-up of a lookahead step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer


class CacheOverflowError(RuntimeError):
    """A forward pass would write past the cache's capacity."""


class _SlotLayer(DynamicLayer):
    """One layer's preallocated keys and values; ``keys``/``values`` are views of the filled prefix."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, key_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self._key_buffer = key_states.new_empty((batch, heads, self.capacity, key_dim))
        self._value_buffer = value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise CacheOverflowError(f"KV cache capacity {self.capacity} exceeded ({end} slots needed)")
        self._key_buffer[:, :, self.length : end] = key_states
        self._value_buffer[:, :, self.length : end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def commit(self, keep: int, sources: torch.Tensor | None) -> None:
        """Keep slots ``[0, keep)`` then ``sources`` (all >= keep, ascending); drop the rest."""
        count = 0 if sources is None else sources.numel()
        if count:
            self._key_buffer[:, :, keep : keep + count] = self._key_buffer[:, :, sources]
            self._value_buffer[:, :, keep : keep + count] = self._value_buffer[:, :, sources]
        self._set_length(keep + count)

    def _set_length(self, length: int) -> None:
        self.length = length
        if self._key_buffer is not None:
            self.keys = self._key_buffer[:, :, :length]
            self.values = self._value_buffer[:, :, :length]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        self._set_length(max(0, self.length - abs(tokens_to_remove)))


class SlotCache(Cache):
    """A preallocated cache for one sequence of at most ``capacity`` tokens across ``num_layers`` layers."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        super().__init__(layers=[_SlotLayer(capacity) for _ in range(num_layers)])
        self.capacity = capacity

    @property
    def length(self) -> int:
        """Slots currently holding committed (or just-computed) tokens."""
        return self.layers[0].length

    def commit(self, keep: int, sources: Sequence[int]) -> None:
        """Keep slots ``[0, keep)`` followed by ``sources`` (ascending, each >= keep); drop every other slot.

        Example: after a step over slots 10..17 that accepted the candidate tokens in slots 14 and 15,
        ``commit(11, [14, 15])`` leaves slots 0..10 in place and moves 14, 15 to 11, 12: length 13.
        """
        in_place = list(sources) == list(range(keep, keep + len(sources)))
        index = None if in_place else torch.tensor(list(sources), device=self.layers[0].device)
        for layer in self.layers:
            if index is None:
                layer._set_length(keep + len(sources))
            else:
                layer.commit(keep, index)


def new_cache(model: torch.nn.Module, capacity: int) -> SlotCache:
    """A ``SlotCache`` sized for ``model`` (its decoder layer count) and ``capacity`` tokens."""
    config = model.config.get_text_config(decoder=True)
    return SlotCache(config.num_hidden_layers, capacity)
