"""Prefix caching across requests: finished decodes' KV, and their copy index, reused by the next prompt that
starts the same way.

Contract: ``PrefixCache(max_tokens)`` keeps copies of finished decodes' KV (``SlotCache.snapshot``: every committed
token but ``last``, prompt and output) with their token ids, least recently used first out, at most ``max_tokens``
tokens in all (an entry longer than that keeps its first ``max_tokens``). ``store(tokens, cache, index)`` adds one;
an entry whose tokens are a prefix of the new one is dropped (the new one holds it), and a new one that is a prefix
of an entry already there only refreshes that entry. ``lookup(prompt, running)`` finds the longest common prefix of
``prompt`` with any entry, or with the prompt slots of a running decode (``running``: ``(tokens, cache, valid)``,
the first ``valid`` slots of ``cache`` holding KV of ``tokens``' first ``valid`` ids), at most ``len(prompt) - 1``
tokens (the last prompt token must run through the model: its logits choose the first output token), and returns a
``PrefixHit``: that many slots of keys and values (a view: copy it at once, ``SlotCache.load_prefix``) and, when the
entry kept one, its copy index cut to them (``ContextIndex.prefix``: equal to the index a decode would build from
those tokens, so the restored guesses are exactly the ones it would find, sooner). Matching is token-exact and at
token granularity (a slot per token).

Entries are copies, never a running decode's own cache: eviction (on ``store``, least recently used first; a hit
refreshes its entry) can only drop what no decode uses, and a running decode's KV is read at ``lookup`` and copied
before the next forward, so it is never evicted or changed. The cache belongs to one engine of one loaded model
(the KV of another model, dtype or weights is never offered: a new engine starts empty); it is never persisted (if
it ever is, key it by the model's fingerprint). Not thread-safe: the engine's thread alone calls it. ``stats()``
reports entries, tokens, bytes, hits, misses, cached tokens and evictions (``PrefixCacheStats``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from decoding.forward.kv_cache import SlotCache
from decoding.proposers.pool import ContextIndex

CHUNK = 64  # tokens compared per slice in ``common_prefix``


def common_prefix(first: Sequence[int], second: Sequence[int], limit: int | None = None) -> int:
    """How many leading ids ``first`` and ``second`` share (at most ``limit``); compared a chunk of ids at a time.

    >>> common_prefix([1, 2, 3, 4], [1, 2, 5]), common_prefix([1, 2, 3], [1, 2, 3], limit=2)
    (2, 2)
    """
    end = min(len(first), len(second), len(first) if limit is None else limit)
    start = 0
    while start < end and first[start : min(start + CHUNK, end)] == second[start : min(start + CHUNK, end)]:
        start = min(start + CHUNK, end)
    while start < end and first[start] == second[start]:
        start += 1
    return start


@dataclass
class _Entry:
    """One cached prefix: its token ids, their keys and values ``[2, layers, 1, heads, tokens, dim]``, and the copy
    index of the decode that left it (None: it kept none, or not a whole one)."""

    tokens: list[int]
    kv: torch.Tensor
    index: ContextIndex | None

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass(frozen=True)
class PrefixHit:
    """What a prompt reuses: ``tokens`` leading ids whose keys and values are ``kv`` (``[2, layers, 1, heads,
    tokens, dim]``, a view of the cache's copy or of a running decode's cache: copy it before the next forward) and
    the copy index over them (None: build it)."""

    tokens: int
    kv: torch.Tensor
    index: ContextIndex | None = None


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache's contents (``entries``, ``tokens``, ``bytes`` of ``capacity`` tokens) and its counters
    since the start: ``hits`` and ``misses`` (lookups), ``cached_tokens`` (prompt tokens reused) and
    ``evictions`` (entries dropped for room; an entry a longer one replaced is not counted)."""

    entries: int = 0
    tokens: int = 0
    bytes: int = 0
    capacity: int = 0
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    evictions: int = 0


Running = tuple[Sequence[int], SlotCache, int]  # a running decode's tokens, its cache, and how many slots are valid


class PrefixCache:
    """A bounded LRU of finished decodes' KV, looked up by longest common prefix (module contract)."""

    def __init__(self, max_tokens: int, restore_index: bool = True) -> None:
        self.max_tokens = max_tokens
        self.restore_index = restore_index  # False: hits carry no copy index (the decode builds its own)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id, least recently used first
        self._next = 0
        self._tokens = 0
        self._bytes = 0
        self._hits = self._misses = self._cached = self._evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int], running: Iterable[Running] = ()) -> PrefixHit | None:
        """The longest reusable prefix of ``prompt`` (module contract), or None (counted as a miss) when no entry or
        running decode shares a first token with it. A hit refreshes its entry."""
        limit = len(prompt) - 1
        best, best_key, best_cache = 0, None, None
        for key, entry in self._entries.items():
            length = common_prefix(entry.tokens, prompt, limit)
            if length > best:
                best, best_key = length, key
        for tokens, cache, valid in running:
            length = common_prefix(tokens, prompt, min(limit, valid))
            if length > best and cache.shared:
                best, best_key, best_cache = length, None, cache
        if best == 0:
            self._misses += 1
            return None
        self._hits += 1
        self._cached += best
        if best_cache is not None:
            return PrefixHit(best, best_cache.view(best))
        entry = self._entries[best_key]
        self._entries.move_to_end(best_key)
        kept = entry.index if self.restore_index else None
        index = kept.prefix(best) if kept is not None and kept.dense >= best else None
        return PrefixHit(best, entry.kv[:, :, :, :, :best], index)

    def store(self, tokens: Sequence[int], cache: SlotCache, index: ContextIndex | None = None) -> bool:
        """Keep a copy of the first ``len(tokens)`` slots of ``cache`` (the KV of ``tokens``) and ``index`` (the copy
        index over them: its part that indexes every position from the first); True when stored. Nothing is stored
        when the cache is off (``max_tokens`` 0), ``tokens`` is empty, or the cache cannot be copied
        (``SlotCache.snapshot``)."""
        length = min(len(tokens), self.max_tokens, cache.length)
        if length <= 0:
            return False
        tokens = list(tokens[:length])
        for key, entry in self._entries.items():
            if len(entry.tokens) >= length and common_prefix(entry.tokens, tokens) == length:
                self._entries.move_to_end(key)  # already held by a longer (or equal) entry
                return False
        kv = cache.snapshot(length)
        if kv is None:
            return False
        for key in [key for key, entry in self._entries.items() if common_prefix(entry.tokens, tokens) ==
                    len(entry.tokens)]:
            self._drop(key)  # held by the new entry
        kept = index.prefix(min(index.dense, length)) if index is not None and index.dense else None
        entry = _Entry(tokens, kv, kept)
        self._entries[self._next] = entry
        self._next += 1
        self._tokens += length
        self._bytes += entry.nbytes
        while self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))
            self._evictions += 1
        return True

    def clear(self) -> None:
        """Drop every entry (not counted as evictions)."""
        for key in list(self._entries):
            self._drop(key)

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._tokens -= len(entry.tokens)
        self._bytes -= entry.nbytes

    def stats(self) -> PrefixCacheStats:
        """Contents and counters (``PrefixCacheStats``)."""
        return PrefixCacheStats(len(self._entries), self._tokens, self._bytes, self.max_tokens, self._hits,
                                self._misses, self._cached, self._evictions)
