"""The n-gram pool: for each token, the most recent n-grams that followed it.

Contract: ``NGramPool(ngram_length, capacity)`` maps a key token to at most ``capacity`` tuples of exactly
``ngram_length`` tokens. Inserting a tuple already present refreshes it (moves it to most recent) instead
of duplicating it; a full key evicts its least recently inserted tuple. ``candidates`` lists the most
recent first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class NGramPool:
    """Candidate continuations keyed by their preceding token.

    >>> pool = NGramPool(ngram_length=2, capacity=2)
    >>> pool.add_sequence([5, 6, 7, 5, 6, 8])
    >>> pool.candidates(5)
    [(6, 8), (6, 7)]
    """

    def __init__(self, ngram_length: int, capacity: int) -> None:
        self.ngram_length = ngram_length
        self.capacity = capacity
        self._table: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._table.values())

    def add(self, key: int, ngram: Sequence[int]) -> None:
        """Insert ``ngram`` (exactly ``ngram_length`` tokens) under ``key``, refreshing it if present."""
        if self.capacity == 0:
            return
        ngram = tuple(ngram)
        if len(ngram) != self.ngram_length:
            raise ValueError(f"expected {self.ngram_length} tokens, got {len(ngram)}")
        entries = self._table.setdefault(key, OrderedDict())
        if ngram in entries:
            entries.move_to_end(ngram)
            return
        entries[ngram] = None
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def add_sequence(self, tokens: Sequence[int], start: int = 0) -> int:
        """Insert every n-gram of ``tokens`` that begins at index >= ``start``; return the next unscanned start.

        The key is ``tokens[i]`` and the n-gram ``tokens[i + 1 : i + 1 + ngram_length]``, for each ``i`` where
        the whole n-gram lies inside ``tokens``. Pass the returned index back as ``start`` after appending
        tokens, and every n-gram is inserted exactly once, in order.
        """
        stop = len(tokens) - self.ngram_length
        for i in range(start, stop):
            self.add(tokens[i], tokens[i + 1 : i + 1 + self.ngram_length])
        return max(start, stop)

    def candidates(self, key: int, limit: int | None = None) -> list[tuple[int, ...]]:
        """The n-grams stored under ``key``, most recent first, at most ``limit`` of them."""
        entries = self._table.get(key)
        if not entries:
            return []
        found = list(reversed(entries))
        return found if limit is None else found[:limit]
