"""The n-gram pool: for each token, the most recent n-grams that followed it.

Contract: ``NGramPool(ngram_length, capacity)`` maps a key token to at most ``capacity`` tuples of 1 to
``ngram_length`` tokens. Inserting a tuple already present refreshes it (moves it to most recent) instead
of duplicating it; a tuple shorter than ``ngram_length`` that is a prefix of one already stored under its key
is not inserted (verifying it would add nothing); a full key evicts its least recently inserted tuple.
``add_chains`` also stores every proper suffix of an n-gram under the token before it. ``candidates`` lists
the most recent first.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence


class NGramPool:
    """Candidate continuations keyed by their preceding token.

    >>> pool = NGramPool(ngram_length=2, capacity=2)
    >>> pool.add_sequence([5, 6, 7, 5, 6, 8])
    4
    >>> pool.candidates(5)
    [(6, 8), (6, 7)]
    """

    def __init__(self, ngram_length: int, capacity: int) -> None:
        self.ngram_length = ngram_length
        self.capacity = capacity
        self._table: dict[int, dict[tuple[int, ...], None]] = {}  # per key: n-grams, oldest first
        # Per key: how many stored n-grams have each proper prefix, so "covered" is one lookup, not a scan.
        self._prefixes: dict[int, dict[tuple[int, ...], int]] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._table.values())

    def add(self, key: int, ngram: Sequence[int]) -> None:
        """Insert ``ngram`` (1 to ``ngram_length`` tokens) under ``key``, refreshing it if present; a shorter one
        that is a prefix of an n-gram already under ``key`` is left out."""
        ngram = tuple(ngram)
        if not 1 <= len(ngram) <= self.ngram_length:
            raise ValueError(f"expected 1 to {self.ngram_length} tokens, got {len(ngram)}")
        if self.capacity:
            self._insert(key, ngram)

    def _insert(self, key: int, ngram: tuple[int, ...]) -> None:
        """``add`` for an n-gram already checked (a tuple of 1 to ``ngram_length`` tokens), capacity > 0. The hot
        path of every window step (W n-grams and their suffixes): kept to plain dict operations."""
        entries = self._table.get(key)
        if entries is None:
            entries = self._table[key] = {}
            prefixes = self._prefixes[key] = {}
        else:
            if ngram in entries:  # refreshed: moved to the end (a plain dict keeps insertion order)
                del entries[ngram]
                entries[ngram] = None
                return
            prefixes = self._prefixes[key]
            if ngram in prefixes:  # a proper prefix of a stored n-gram: verifying it would add nothing
                return
        entries[ngram] = None
        for end in range(1, len(ngram)):
            prefix = ngram[:end]
            prefixes[prefix] = prefixes.get(prefix, 0) + 1
        if len(entries) > self.capacity:
            evicted = next(iter(entries))  # the oldest
            del entries[evicted]
            for end in range(1, len(evicted)):
                prefix = evicted[:end]
                count = prefixes[prefix] - 1
                if count:
                    prefixes[prefix] = count
                else:
                    del prefixes[prefix]

    def add_chains(self, ngrams: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Insert each ``(key, ngram)`` of ``ngrams``, then each n-gram's proper suffixes ``ngram[i:]`` under the
        token before them, ``ngram[i - 1]``.

        A Jacobi window column is a chain of guesses for consecutive positions, each read off the model after the
        ones before it: every token of it, not only the first, can key the guesses that follow it. The shorter
        n-grams key more of the tokens a decode reaches, so more steps find a candidate.

        >>> pool = NGramPool(ngram_length=3, capacity=4)
        >>> pool.add_chains([(1, (2, 3, 4)), (5, (2, 3, 6))])
        >>> pool.candidates(1), pool.candidates(2), pool.candidates(3)
        ([(2, 3, 4)], [(3, 6), (3, 4)], [(6,), (4,)])
        """
        chains = [(key, tuple(ngram)) for key, ngram in ngrams]
        for _, ngram in chains:
            if not 1 <= len(ngram) <= self.ngram_length:
                raise ValueError(f"expected 1 to {self.ngram_length} tokens, got {len(ngram)}")
        if not self.capacity:
            return
        insert = self._insert
        for key, ngram in chains:
            insert(key, ngram)
        for _, ngram in chains:
            for start in range(1, len(ngram)):
                insert(ngram[start - 1], ngram[start:])

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


def covered(candidate: Sequence[int], chosen: Iterable[Sequence[int]]) -> bool:
    """True when ``candidate`` equals, or is a prefix of, one of ``chosen``: verifying it would add nothing.

    >>> covered((3, 4), [(3, 4, 5)]), covered((3, 5), [(3, 4, 5)])
    (True, False)
    """
    candidate = tuple(candidate)
    return any(tuple(other[: len(candidate)]) == candidate for other in chosen)


class ContextIndex:
    """Where each token occurs in the text so far (prompt and/or output), to propose copied continuations.

    ``candidates(tokens, length, limit)`` looks at every earlier occurrence ``i`` of ``tokens[-1]`` whose
    continuation ``tokens[i+1 : i+1+length]`` is complete, and ranks them by how many tokens before ``i``
    agree with the tokens before the end (longest matching context first, then most recent): the
    continuation of the best-matching earlier context is the likeliest to be copied again.

    >>> index = ContextIndex()
    >>> tokens = [1, 2, 3, 9, 2, 3, 7, 1, 2]
    >>> index.extend(tokens)
    >>> index.candidates(tokens, length=2, limit=2)
    [(3, 9), (3, 7)]
    """

    MAX_MATCH = 8
    STRONG_MATCH = 5  # best_copy: matches this long count alike, so longer continuations win among them

    def __init__(self) -> None:
        self._positions: dict[int, list[int]] = {}
        self._indexed = 0
        self._dense = 0  # positions [0, _dense) are all indexed (no skip_to gap before them)

    @property
    def dense(self) -> int:
        """How many leading positions are all indexed: ``prefix`` can cut the index anywhere up to there."""
        return self._dense

    def extend(self, tokens: Sequence[int], upto: int | None = None) -> None:
        """Index ``tokens[indexed:upto]`` (default: to the end); positions already indexed are skipped."""
        start, stop = self._indexed, len(tokens) if upto is None else upto
        if stop <= start:
            return
        positions = self._positions
        for position in range(start, stop):
            found = positions.get(tokens[position])
            if found is None:
                positions[tokens[position]] = [position]
            else:
                found.append(position)
        if self._dense == start:
            self._dense = stop
        self._indexed = stop

    def skip_to(self, position: int) -> None:
        """Leave positions before ``position`` unindexed (e.g. the prompt, when only the output is a source)."""
        self._indexed = max(self._indexed, position)

    def prefix(self, length: int) -> ContextIndex:
        """A new index of positions ``[0, length)`` alone, equal to ``ContextIndex().extend(tokens, length)`` over
        the same tokens (this one is left as it is). Raises ``ValueError`` past ``dense``.

        >>> index = ContextIndex()
        >>> index.extend([1, 2, 1, 3])
        >>> index.prefix(3)._positions
        {1: [0, 2], 2: [1]}
        """
        if length > self._dense:
            raise ValueError(f"positions up to {length} asked of an index dense up to {self._dense}")
        copy = ContextIndex()
        for token, positions in self._positions.items():
            kept = positions[: bisect.bisect_left(positions, length)]
            if kept:
                copy._positions[token] = kept
        copy._indexed = copy._dense = length
        return copy

    def candidates(self, tokens: Sequence[int], length: int, limit: int) -> list[tuple[int, ...]]:
        """Up to ``limit`` distinct continuations of ``tokens[-1]``, best context match first."""
        if limit <= 0:
            return []
        end = len(tokens) - 1
        scored = []
        for position in self._positions.get(tokens[end], ()):
            if position + length >= end + 1 or position == end:
                continue
            scored.append((self._match(tokens, position, end), position))
        scored.sort(reverse=True)
        found: list[tuple[int, ...]] = []
        for _, position in scored:
            continuation = tuple(tokens[position + 1 : position + 1 + length])
            if continuation not in found:
                found.append(continuation)
                if len(found) == limit:
                    break
        return found

    def best_copy(self, tokens: Sequence[int], length: int, min_match: int) -> tuple[int, ...] | None:
        """The continuation (up to ``length`` tokens, at least 2) of the earlier occurrence of ``tokens[-1]``
        whose preceding context matches the text's best, if at least ``min_match`` tokens match; else None.

        Among the occurrences that match enough, the stronger match wins (matches of ``STRONG_MATCH`` or more
        tokens count alike), then the longest continuation, then the better match, then the most recent: in
        periodic text ("()()()") the latest occurrence is a period back and its continuation runs into the present
        after a few tokens, while an older one continues for ``length`` tokens.

        >>> index = ContextIndex()
        >>> tokens = [4, 5, 6, 1, 2, 3, 9, 8, 7, 5, 6, 1, 2]
        >>> index.extend(tokens)
        >>> index.best_copy(tokens, length=4, min_match=3)
        (3, 9, 8, 7)
        >>> index.best_copy(tokens, length=4, min_match=5) is None
        True
        >>> periodic = [7, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1]
        >>> index = ContextIndex()
        >>> index.extend(periodic)
        >>> index.best_copy(periodic, length=4, min_match=3)
        (2, 1, 2, 1)
        >>> weak = [3, 1, 9, 9, 9, 9, 4, 2, 1, 8, 2, 1]  # "2 1" matches before "8 2 1", not before "9 9 9 9"
        >>> index = ContextIndex()
        >>> index.extend(weak)
        >>> index.best_copy(weak, length=4, min_match=0)  # the stronger match beats the longer continuation
        (8, 2, 1)
        """
        found = self.best_copies(tokens, length, min_match, limit=1)
        return found[0] if found else None

    def best_copies(
        self, tokens: Sequence[int], length: int, min_match: int, limit: int
    ) -> list[tuple[int, ...]]:
        """Up to ``limit`` continuations in ``best_copy``'s order, from different earlier occurrences; one that
        is a prefix of (or equal to) a continuation already chosen is skipped, since it would verify nothing new.

        >>> index = ContextIndex()
        >>> tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 8, 2, 3, 4, 9, 7, 2, 3]
        >>> index.extend(tokens)
        >>> index.best_copies(tokens, length=3, min_match=0, limit=3)
        [(4, 9, 7), (5, 6, 8), (4, 9, 2)]
        """
        end = len(tokens) - 1
        ranked = []  # (strength, continuation length, match, position)
        for position in self._positions.get(tokens[end], ()):
            if position >= end - 1:
                continue
            match = self._match(tokens, position, end)
            if match >= min_match:
                ranked.append((min(match, self.STRONG_MATCH), min(end - position, length), match, position))
        ranked.sort(reverse=True)
        found: list[tuple[int, ...]] = []
        for _, available, _, position in ranked:
            continuation = tuple(tokens[position + 1 : position + 1 + available])
            if not covered(continuation, found):
                found.append(continuation)
                if len(found) == limit:
                    break
        return found

    def _match(self, tokens: Sequence[int], position: int, end: int) -> int:
        """How many tokens before ``position`` equal those before ``end`` (at most ``MAX_MATCH``)."""
        count = 0
        while count < self.MAX_MATCH and position - count - 1 >= 0:
            if tokens[position - count - 1] != tokens[end - count - 1]:
                break
            count += 1
        return count
