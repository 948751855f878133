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

import array
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

    # ``keys``/``values`` are the filled prefix of the buffers, made when read: a commit or a static step moves
    # ``length`` without making 2 views per layer (the Cache mixin only ever assigns them None).
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._key_buffer is None else self._key_buffer[:, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("a slot layer's keys are a view of its buffer; write through update()")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._value_buffer is None else self._value_buffer[:, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("a slot layer's values are a view of its buffer; write through update()")

    def _own_buffers(self, key_states: torch.Tensor, value_states: torch.Tensor) -> _Buffers:
        """Key and value buffers of this layer alone."""
        batch, heads, _, key_dim = key_states.shape
        return (
            key_states.new_empty((batch, heads, self.capacity, key_dim)),
            value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1])),
        )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        allocate = self._allocate or self._own_buffers
        self.bind(*allocate(key_states, value_states))

    def bind(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor) -> None:
        """Use ``[batch, heads, >= capacity, dim]`` buffers allocated elsewhere (this layer's, or a pool's)."""
        self.dtype, self.device = key_buffer.dtype, key_buffer.device
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
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

    def __init__(self, num_layers: int, capacity: int, storage: torch.Tensor | None = None) -> None:
        """``storage`` (optional): a ``[2, layers, 1, heads, >= capacity, dim]`` tensor (a ``KVPool`` row) that
        every layer's buffers are views of from the start; without it each cache allocates on first use."""
        self._storage: torch.Tensor | None = None  # [2, layers, batch, heads, capacity, dim]: keys, values
        self._in_storage = 0  # layers whose buffers are views of _storage
        super().__init__(layers=[_SlotLayer(capacity, self._shared_buffers(index)) for index in range(num_layers)])
        self.capacity = capacity
        self.pool: KVPool | None = None  # the pool this cache is a row of (None: its own memory)
        self.pool_row: int | None = None
        # the fused CPU step's tables of this cache's buffer addresses (decoding.forward.fused), made on its first
        # step: a layer's buffers never move once bound
        self.native_tables: tuple | None = None
        if storage is not None:
            self._storage, self._in_storage = storage, num_layers
            for index, layer in enumerate(self.layers):
                layer.bind(storage[0, index], storage[1, index])

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
        if any(source != keep + offset for offset, source in enumerate(sources)):  # else already in place
            if self.pool is not None:  # moved with every other row's commits, before the pool is next read
                self.pool.defer(self.pool_row, keep, sources)
                self._set_lengths(keep + count)
                return
            index = torch.tensor(sources, device=self.layers[0].device)
            if self._storage is None or self._in_storage < len(self.layers):
                for layer in self.layers:
                    layer.commit(keep, index)
                return
            self._storage[:, :, :, :, keep : keep + count] = self._storage[:, :, :, :, index]
        self._set_lengths(keep + count)

    @property
    def shared(self) -> bool:
        """True when every layer's keys and values are views of one storage (``snapshot`` and ``load_prefix`` work)."""
        return self._storage is not None and self._in_storage == len(self.layers)

    def snapshot(self, length: int) -> torch.Tensor | None:
        """A copy of slots ``[0, length)`` of every layer, ``[2, layers, batch, heads, length, dim]`` (keys, then
        values), its pool's deferred commits applied first; None when the layers do not share one storage (a model
        whose layers differ in shape) or ``length`` is outside ``[1, self.length]``."""
        if not self.shared or not 0 < length <= self.length:
            return None
        if self.pool is not None:
            self.pool.flush()
        return self._storage[:, :, :, :, :length].clone()

    def view(self, length: int) -> torch.Tensor:
        """Slots ``[0, length)`` of every layer as a view of the shared storage, ``[2, layers, batch, heads, length,
        dim]`` (no copy: read it before the next forward). Raises ``ValueError`` when the layers share none."""
        if not self.shared:
            raise ValueError("this cache's layers do not share one storage")
        return self._storage[:, :, :, :, :length]

    def load_prefix(self, kv: torch.Tensor) -> None:
        """Start this empty cache with ``kv`` (a ``snapshot``, or a slice of one, of a cache of the same model):
        slots ``[0, kv.shape[-2])`` become those keys and values, ``length`` that count; the buffers are allocated
        first when no forward has run. Raises ``ValueError`` when the cache is not empty or ``kv`` does not fit its
        layers, ``CacheOverflowError`` when it holds more slots than the capacity."""
        length = kv.shape[-2]
        if self.length:
            raise ValueError("load_prefix needs an empty cache")
        if length > self.capacity:
            raise CacheOverflowError(f"KV cache capacity {self.capacity} exceeded ({length} slots needed)")
        if kv.dim() != 6 or kv.shape[:2] != (2, len(self.layers)):
            raise ValueError(f"expected [2, {len(self.layers)}, batch, heads, slots, dim] keys and values")
        for index, layer in enumerate(self.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(kv[0, index], kv[1, index])
        storage = self._storage
        if not self.shared or storage.shape[2:4] != kv.shape[2:4] or storage.shape[-1] != kv.shape[-1]:
            raise ValueError("keys and values of another shape than this cache's")
        storage[:, :, :, :, :length].copy_(kv)
        self._set_lengths(length)

    def advance(self, count: int) -> None:
        """Count ``count`` slots written past ``length`` by someone else (a static step) as filled."""
        end = self.length + count
        if end > self.capacity:
            raise CacheOverflowError(f"KV cache capacity {self.capacity} exceeded ({end} slots needed)")
        self._set_lengths(end)

    def _set_lengths(self, length: int) -> None:
        for layer in self.layers:
            layer.length = length


def new_cache(model: torch.nn.Module, capacity: int) -> SlotCache:
    """A ``SlotCache`` sized for ``model`` (its decoder layer count) and ``capacity`` tokens."""
    config = model.config.get_text_config(decoder=True)
    return SlotCache(config.num_hidden_layers, capacity)


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of ``model``'s decoder."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


class KVPool:
    """Every sequence's KV cache in one tensor allocated once: ``sequences`` rows plus one scratch row.

    ``storage`` is ``[layers, rows, 2, kv_heads, row_capacity, head_dim]`` (keys then values), zeroed, so that no
    slot ever holds a NaN that a masked attention weight could multiply. A row holds ``capacity`` tokens of one
    sequence plus ``scratch_tokens`` slots past them, where a static step writes its padding tokens; the last row
    is the scratch of padding sequences. ``acquire(capacity)`` hands out a free row as a ``SlotCache`` (None when
    every row is taken or it is too short: the caller then allocates a cache of its own), ``release`` takes it
    back. ``layer_views[l]`` is layer ``l`` as ``[rows, 2 * kv_heads, row_capacity, head_dim]``: what a static
    step writes by index and reads. Nothing is reallocated while the pool lives.
    """

    def __init__(
        self, model: torch.nn.Module, sequences: int, capacity: int, scratch_tokens: int = 128,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        layers, kv_heads, head_dim = kv_shape(model)
        self.capacity, self.sequences, self.scratch_row = capacity, sequences, sequences
        self.row_capacity = capacity + scratch_tokens
        self.storage = torch.zeros(
            (layers, sequences + 1, 2, kv_heads, self.row_capacity, head_dim),
            dtype=dtype or model.dtype, device=device or model.device,
        )
        self.layer_views = [layer.view(sequences + 1, 2 * kv_heads, self.row_capacity, head_dim)
                            for layer in self.storage]
        self._slots = self.storage.view(layers, -1, head_dim)  # [layers, rows * 2 kv * slots, dim]
        self._heads = torch.arange(2 * kv_heads, device=self.storage.device)
        self._free = list(range(sequences - 1, -1, -1))  # popped from the end: row 0 first
        self._moves: list[tuple[int, int, list[int]]] = []  # deferred commits: (row, keep, sources)
        self.staged = self.storage.device.type == "cuda"  # moves' indices go through _staging (_index_on_device)
        self._staging: torch.Tensor | None = None  # pinned on CUDA: the moves' indices on their way
        self._staged = None  # the CUDA event of the last staged copy

    @property
    def free(self) -> int:
        """Rows not handed out."""
        return len(self._free)

    def acquire(self, capacity: int) -> SlotCache | None:
        """A free row as a cache of ``capacity`` tokens (length 0), or None if none is free or ``capacity`` is
        more than a row holds."""
        if capacity > self.capacity or not self._free:
            return None
        row = self._free.pop()
        storage = self.storage[:, row : row + 1].permute(2, 0, 1, 3, 4, 5)  # [2, layers, 1, heads, slots, dim]
        cache = SlotCache(self.storage.shape[0], capacity, storage)
        cache.pool, cache.pool_row = self, row
        return cache

    def release(self, cache: SlotCache) -> None:
        """Give ``cache``'s row back, its deferred moves dropped (a cache not from this pool is ignored)."""
        row = cache.pool_row
        if cache.pool is not self or row is None:
            return
        self._moves = [move for move in self._moves if move[0] != row]
        cache.pool, cache.pool_row = None, None
        self._free.append(row)

    def _index_on_device(self, values: array.array) -> torch.Tensor:
        """``values`` as an int64 tensor on the pool's device. When ``staged`` (on CUDA; a CUDA rehearsal on the
        CPU sets it) through one reused staging buffer (pinned on CUDA, copied without blocking; the copy before
        is waited for first, so the buffer is never overwritten under it). Callable in or out of inference mode:
        the buffer is written in it, whichever mode created it."""
        host = torch.frombuffer(values, dtype=torch.long)
        if not self.staged:
            return host
        cuda = self.storage.device.type == "cuda"
        with torch.inference_mode():
            if self._staging is None or self._staging.numel() < host.numel():
                self._staging = torch.empty(max(host.numel(), 4096), dtype=torch.long, pin_memory=cuda)
            if self._staged is not None:
                self._staged.synchronize()
            staging = self._staging[: host.numel()]
            staging.copy_(host)
            if not cuda:
                return staging.clone()
            index = staging.to(self.storage.device, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return index

    def defer(self, row: int, keep: int, sources: Sequence[int]) -> None:
        """Record a commit of row ``row`` (``SlotCache.commit``'s ``keep`` and ``sources``, ascending) for
        ``flush``. Raises ``IndexError`` for slots outside the row (checked here, on the host: on a GPU an index
        out of range in ``apply_moves`` would be a device-side assert that poisons the CUDA context)."""
        sources = list(sources)
        if not 0 <= row <= self.sequences or (sources and not (keep <= sources[0] and sources[-1] < self.row_capacity)):
            raise IndexError(f"KV pool commit out of range: row {row} of {self.sequences + 1}, keep {keep}, "
                             f"sources {sources[:1]}..{sources[-1:]} of {self.row_capacity} slots")
        self._moves.append((row, keep, sources))

    def flush(self) -> None:
        """Apply every deferred commit: one copy of host ints (pinned, not blocking on CUDA), then one gather and
        one scatter of slots over all rows, keys/values and layers (``apply_moves``); a commit's slots move in
        ascending order, so gathering all before scattering any reads none that it overwrote. Readers of the pool
        (forwards) call it first."""
        self.apply_moves(self.stage_moves())

    def stage_moves(self) -> tuple[int, torch.Tensor] | None:
        """``flush``'s host part: the deferred moves as ``(count, index)``, the index (each moved slot's row,
        target and origin: three runs of ``count`` ints) on its way to the device; None when there are none. The
        moves are forgotten."""
        if not self._moves:
            return None
        rows, targets, origins = array.array("q"), array.array("q"), array.array("q")
        for row, keep, sources in self._moves:
            rows.extend([row] * len(sources))
            targets.extend(range(keep, keep + len(sources)))
            origins.extend(sources)
        self._moves.clear()
        return len(rows), self._index_on_device(rows + targets + origins)

    def apply_moves(self, staged: tuple[int, torch.Tensor] | None) -> None:
        """``flush``'s device part: every moved slot of every KV head (keys, then values), gathered then scattered
        over all layers at once. Slot s of row r, head h is entry ``(r * 2 * heads + h) * row_capacity + s`` of
        a layer's ``[rows * 2 * heads * row_capacity, dim]`` view."""
        if staged is None:
            return
        count, index = staged
        rows, targets, origins = index.view(3, count, 1)
        heads = self.layer_views[0].shape[1]
        base = (rows * heads + self._heads) * self.row_capacity  # [count, 2 heads]
        moved = self._slots.index_select(1, (base + origins).flatten())  # gathered before any is overwritten
        self._slots.index_copy_(1, (base + targets).flatten(), moved)
