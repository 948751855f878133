"""A preallocated KV cache written in place, with a one-call commit for multi-branch steps.

Contract: ``SlotCache`` is a transformers ``Cache`` whose layers hold ``[batch, heads, capacity, head_dim]``
buffers allocated once. A forward pass appends its keys/values at ``length`` (no concatenation, no copy of
the past); ``commit(keep, sources)`` keeps the first ``keep`` slots followed by the slots listed in
``sources`` and drops everything else. That is the whole KV fix-up of a lookahead step. When every layer's
keys and values have one shape (LLaMA, Qwen2...), all buffers are views of one tensor and a commit that moves
slots is one gather and one copy for all layers, not two of each per layer (on a GPU, 2 launches instead of 120
for a 30-layer model).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer


class CacheOverflowError(RuntimeError):
    """A forward pass would write past the cache's capacity."""


_Buffers = tuple[torch.Tensor, torch.Tensor]


class _SlotLayer(DynamicLayer):
    """One layer's preallocated keys and values; ``keys``/``values`` are views of the filled prefix."""

    def __init__(self, capacity: int, allocate: Callable[[torch.Tensor, torch.Tensor], _Buffers] | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._allocate = allocate  # used once; it must not hold the layer or its cache (no reference cycle)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def _own_buffers(self, key_states: torch.Tensor, value_states: torch.Tensor) -> _Buffers:
        """Key and value buffers of this layer alone."""
        batch, heads, _, key_dim = key_states.shape
        return (
            key_states.new_empty((batch, heads, self.capacity, key_dim)),
            value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1])),
        )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        allocate = self._allocate or self._own_buffers
        self._key_buffer, self._value_buffer = allocate(key_states, value_states)
        self._allocate = None
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
        self._storage: torch.Tensor | None = None  # [2, layers, batch, heads, capacity, dim]: keys, values
        self._in_storage = 0  # layers whose buffers are views of _storage
        super().__init__(layers=[_SlotLayer(capacity, self._shared_buffers(index)) for index in range(num_layers)])
        self.capacity = capacity

    def _shared_buffers(self, index: int) -> Callable[[torch.Tensor, torch.Tensor], _Buffers]:
        """Layer ``index``'s allocator: views of the shared storage (made by the first layer to need buffers) when
        its keys and values fit it, else buffers of its own. It holds the cache weakly, so that a cache dropped
        before every layer ran frees its memory at once rather than at the next garbage collection."""
        cache_ref = weakref.ref(self)

        def allocate(key_states: torch.Tensor, value_states: torch.Tensor) -> _Buffers:
            cache = cache_ref()
            layer = cache.layers[index]
            batch, heads, _, dim = key_states.shape
            shape = (2, len(cache.layers), batch, heads, cache.capacity, dim)
            fits = value_states.shape == key_states.shape and value_states.dtype == key_states.dtype
            if cache._storage is None and fits:
                cache._storage = key_states.new_empty(shape)
            storage = cache._storage
            same = storage is not None and (storage.shape, storage.dtype, storage.device) == (
                shape, key_states.dtype, key_states.device
            )
            if not (fits and same):
                return layer._own_buffers(key_states, value_states)
            cache._in_storage += 1
            return storage[0, index], storage[1, index]

        return allocate

    @property
    def length(self) -> int:
        """Slots currently holding committed (or just-computed) tokens."""
        return self.layers[0].length

    def commit(self, keep: int, sources: Sequence[int]) -> None:
        """Keep slots ``[0, keep)`` followed by ``sources`` (ascending, each >= keep); drop every other slot.

        Example: after a step over slots 10..17 that accepted the candidate tokens in slots 14 and 15,
        ``commit(11, [14, 15])`` leaves slots 0..10 in place and moves 14, 15 to 11, 12: length 13.
        """
        count = len(sources)
        if list(sources) != list(range(keep, keep + count)):  # else the kept slots are already in place
            index = torch.tensor(list(sources), device=self.layers[0].device)
            if self._storage is None or self._in_storage < len(self.layers):
                for layer in self.layers:
                    layer.commit(keep, index)
                return
            self._storage[:, :, :, :, keep : keep + count] = self._storage[:, :, :, :, index]
        for layer in self.layers:
            layer._set_length(keep + count)


def new_cache(model: torch.nn.Module, capacity: int) -> SlotCache:
    """A ``SlotCache`` sized for ``model`` (its decoder layer count) and ``capacity`` tokens."""
    config = model.config.get_text_config(decoder=True)
    return SlotCache(config.num_hidden_layers, capacity)
