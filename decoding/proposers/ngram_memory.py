"""The server-wide n-gram memory: recent documents (completions) of every request, offered as candidates.

Contract: ``NGramMemory(max_tokens)`` stores whole documents (``add``) in a ring of at most ``max_tokens``
tokens (token ids are ints in [0, 2**32)); when a new document does not fit, the oldest documents are evicted
whole (a document longer than ``max_tokens`` keeps its last ``max_tokens`` tokens).
``candidates(tokens, length, limit, min_match)`` returns up to ``limit`` distinct continuations (1..``length``
tokens each) of the stored occurrences of ``tokens[-1]`` whose preceding tokens match the tokens before
``tokens[-1]`` for at least ``min_match`` tokens, ranked as ``ContextIndex.best_copy`` ranks copies
(``decoding.proposers.pool``). Neither a match nor a continuation ever crosses a document boundary.

Bounds: a lookup searches only the ``max_occurrences`` most recent occurrences of the last two tokens (with
``min_match >= 1``) or of the last token (``min_match == 0``), so it costs O(``max_occurrences`` x
``MAX_MATCH``) whatever the memory's size. Memory: five int64 arrays of ``max_tokens`` entries (the tokens,
their documents' bounds, and two chains linking each position to the previous occurrence of its token and of
its pair) plus one dictionary entry per distinct token and pair stored: about 110 bytes per token in all
(22 MB for 200,000 tokens of text).

Not thread-safe: one thread (the engine's, which owns the device) adds and looks up. Candidates are guesses
only: whoever verifies them decides what is kept, so the memory can change how fast a decode runs, never its
greedy output.

A corpus (text an operator loads: a codebase, documents) enters as documents too: ``corpus_documents(tokens)``
cuts one text's tokens into documents of at most ``CORPUS_DOCUMENT_TOKENS``, each then ``add``-ed like a
completion (the same bound, the same eviction). ``usage()`` reports the stored tokens and documents against the
capacity (``MemoryUsage``).

Persistence: ``snapshot()`` lists the stored documents, oldest first; ``save_memory(memory, path, vocabulary)``
writes them to a gzipped JSON file (atomically: written beside it, then renamed) under the id of the tokenizer's
vocabulary that gives the ids their meaning (``vocabulary_id``), and ``load_memory(memory, path, vocabulary)``
adds a saved file's documents to a memory, oldest first, so a restarted server starts with what it had learned
(or with a memory built from other text). A file of another vocabulary, or one that cannot be read, raises
``MemoryFileError`` and adds nothing.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from decoding.proposers.pool import ContextIndex

TOKEN_LIMIT = 1 << 32  # token ids lie in [0, TOKEN_LIMIT): a pair (a, b) is keyed by the int a * TOKEN_LIMIT + b
CORPUS_DOCUMENT_TOKENS = 4096  # a corpus text enters the memory in documents of at most this many tokens


@dataclass(frozen=True)
class MemoryUsage:
    """What a memory holds: ``tokens`` and ``documents`` stored, of at most ``capacity`` tokens."""

    tokens: int
    documents: int
    capacity: int


class NGramMemory:
    """A bounded ring of recent documents, indexed by token and by adjacent pair of tokens.

    >>> memory = NGramMemory(max_tokens=16)
    >>> memory.add([1, 2, 3, 4])
    >>> memory.add([9, 2, 3, 5, 6])
    >>> len(memory), memory.documents
    (9, 2)
    >>> memory.candidates([7, 1, 2], length=3, limit=2)  # only "1 2" matches: the second 2 follows 9
    [(3, 4)]
    >>> memory.candidates([7, 1, 2], length=3, limit=2, min_match=0)  # the stronger match ranks first
    [(3, 4), (3, 5, 6)]
    >>> memory.add(list(range(10, 20)))  # 19 tokens do not fit in 16: the oldest document goes
    >>> len(memory), memory.documents, memory.candidates([1, 2], length=3, limit=2)
    (15, 2, [])
    """

    MAX_MATCH = ContextIndex.MAX_MATCH  # tokens compared backwards from the last one
    STRONG_MATCH = ContextIndex.STRONG_MATCH  # matches this long count alike

    def __init__(self, max_tokens: int, max_occurrences: int = 32) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {max_occurrences}")
        self.max_tokens = max_tokens
        self.max_occurrences = max_occurrences
        # Token i of the stream of all stored documents (i counts from the first token ever added) lives in
        # slot i % max_tokens, with the absolute bounds [start, end) of its document beside it.
        self._tokens = _int64s(max_tokens)
        self._starts = _int64s(max_tokens)
        self._ends = _int64s(max_tokens)
        self._by_token = _Chains(max_tokens)
        self._by_pair = _Chains(max_tokens)  # a position is linked here when its document has a token before it
        self._documents: deque[tuple[int, int]] = deque()  # (start, end) of each stored document, oldest first
        self._first = 0  # absolute position of the oldest stored token
        self._next = 0  # absolute position the next token gets

    def clear(self) -> None:
        """Forget every document (the memory is then as new)."""
        self.__init__(self.max_tokens, self.max_occurrences)

    def __len__(self) -> int:
        """Tokens stored."""
        return self._next - self._first

    @property
    def documents(self) -> int:
        """Documents stored (an evicted document no longer counts)."""
        return len(self._documents)

    def usage(self) -> MemoryUsage:
        """The tokens and documents stored now, and the capacity."""
        return MemoryUsage(len(self), self.documents, self.max_tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """Store ``tokens`` as one document, evicting the oldest documents until it fits (see the contract).

        An empty document stores nothing; a token id outside [0, 2**32) raises ``ValueError`` (nothing stored).
        """
        kept = [int(token) for token in tokens][-self.max_tokens :]
        if not kept:
            return
        if not 0 <= min(kept) <= max(kept) < TOKEN_LIMIT:
            raise ValueError(f"token ids must lie in [0, {TOKEN_LIMIT}), got {min(kept)}..{max(kept)}")
        while len(self) + len(kept) > self.max_tokens:
            self._evict_oldest()
        start, end = self._next, self._next + len(kept)
        previous = None
        for position, token in enumerate(kept, start):
            slot = position % self.max_tokens
            self._tokens[slot], self._starts[slot], self._ends[slot] = token, start, end
            self._by_token.link(token, position, slot)
            if previous is not None:
                self._by_pair.link(previous * TOKEN_LIMIT + token, position, slot)
            previous = token
        self._documents.append((start, end))
        self._next = end

    def add_documents(self, documents: Sequence[Sequence[int]]) -> MemoryUsage:
        """``add`` each of ``documents`` in order (a corpus, a memory file); the usage after."""
        for document in documents:
            self.add(document)
        return self.usage()

    def snapshot(self) -> list[list[int]]:
        """The stored documents, oldest first (``add``-ing them in order to an empty memory of the same size
        rebuilds this one)."""
        return [list(self._read(start, end - start)) for start, end in self._documents]

    def _evict_oldest(self) -> None:
        """Drop the oldest document, and every index key whose latest position it held."""
        start, end = self._documents.popleft()
        self._first = end
        previous = None
        for position in range(start, end):
            token = self._tokens[position % self.max_tokens]
            self._by_token.unlink(token, position)
            if previous is not None:
                self._by_pair.unlink(previous * TOKEN_LIMIT + token, position)
            previous = token

    def candidates(
        self, tokens: Sequence[int], length: int, limit: int, min_match: int = 1
    ) -> list[tuple[int, ...]]:
        """Up to ``limit`` distinct continuations of ``tokens[-1]`` from the memory, best first.

        A stored occurrence ``p`` of ``tokens[-1]`` qualifies when at least ``min_match`` tokens before it, in
        its own document, equal the tokens before ``tokens[-1]`` (compared up to ``MAX_MATCH``) and its
        document goes on after it; its continuation is the next ``length`` tokens, fewer where the document
        ends. Order: the stronger match (matches of ``STRONG_MATCH`` or more count alike), then the longer
        continuation, then the longer match, then the most recent. A continuation equal to, or a prefix of, one
        already chosen is skipped. Only the ``max_occurrences`` most recent occurrences of ``tokens[-2:]`` (of
        ``tokens[-1]`` when ``min_match`` is 0) are looked at.
        """
        if limit <= 0 or length <= 0 or len(tokens) == 0 or not 0 <= tokens[-1] < TOKEN_LIMIT:
            return []
        ranked = self._rank(tokens, length, min_match)
        found: list[tuple[int, ...]] = []
        seen: set[tuple[int, ...]] = set()  # the chosen continuations and all their prefixes
        for _, available, _, position in ranked:
            continuation = self._read(position + 1, available)
            if continuation not in seen:
                found.append(continuation)
                if len(found) == limit:
                    break
                seen.update(continuation[:count] for count in range(1, available + 1))
        return found

    def _rank(self, tokens: Sequence[int], length: int, min_match: int) -> list[tuple[int, int, int, int]]:
        """``(strength, continuation length, match, position)`` of each qualifying occurrence, best first."""
        if min_match >= 1:
            if len(tokens) < 2 or not 0 <= tokens[-2] < TOKEN_LIMIT:
                return []
            occurrences = self._by_pair.recent(tokens[-2] * TOKEN_LIMIT + tokens[-1], self._first, self.max_occurrences)
        else:
            occurrences = self._by_token.recent(tokens[-1], self._first, self.max_occurrences)
        if not occurrences:
            return []
        context = array("q", tokens[-self.MAX_MATCH - 1 : -1])  # the tokens before tokens[-1]
        previous = context[-1] if context else None
        stored, ends, size, strong = self._tokens, self._ends, self.max_tokens, self.STRONG_MATCH
        ranked = []
        for position in occurrences:  # the hot loop: up to max_occurrences times per decode step
            slot = position % size
            available = ends[slot] - position - 1
            if available < 1:
                continue
            match = 0
            if stored[slot - 1] == previous:  # slot - 1 = -1 is the ring's last slot: still the predecessor
                match = self._match(context, position, self._starts[slot])
            if match >= min_match:
                strength = match if match < strong else strong
                ranked.append((strength, available if available < length else length, match, position))
        ranked.sort(reverse=True)
        return ranked

    def _match(self, context: array, position: int, start: int) -> int:
        """How many tokens right before ``position`` (none before ``start``, its document's first) equal the
        last ones of ``context``, at most ``len(context)``."""
        stored, size = self._tokens, self.max_tokens
        limit = min(len(context), position - start)
        slot = position % size
        if limit <= slot and stored[slot - limit : slot] == context[len(context) - limit :]:
            return limit  # the whole context matches (the common case in repetitive text), compared in C
        count = 0
        while count < limit and stored[(position - count - 1) % size] == context[-count - 1]:
            count += 1
        return count

    def _read(self, position: int, count: int) -> tuple[int, ...]:
        """The ``count`` stored tokens from absolute ``position`` on."""
        stored, size = self._tokens, self.max_tokens
        slot = position % size
        if slot + count <= size:
            return tuple(stored[slot : slot + count])
        return tuple(stored[(position + offset) % size] for offset in range(count))



def corpus_documents(tokens: Sequence[int], size: int = CORPUS_DOCUMENT_TOKENS) -> list[list[int]]:
    """One corpus text's tokens cut into the documents it enters the memory as: runs of at most ``size`` tokens,
    in order (none for no tokens), so a match never spans more than one run.

    >>> corpus_documents([1, 2, 3, 4, 5], size=2)
    [[1, 2], [3, 4], [5]]
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    return [list(tokens[start : start + size]) for start in range(0, len(tokens), size)]


class _Chains:
    """An index from keys to positions as hash chains (as in LZ77 compressors): ``heads[key]`` is the key's latest
    position, ``chain[slot of p]`` the position of the key's occurrence before ``p`` (-1: none).

    Positions before the memory's first live one are stale: ``recent`` stops at the first it meets (a chain
    descends), and ``unlink`` drops a key whose latest position is evicted, so keys never outnumber live tokens.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.heads: dict[int, int] = {}
        self.chain = _int64s(size)

    def link(self, key: int, position: int, slot: int) -> None:
        """Record ``position`` (at ``slot``) as the latest occurrence of ``key``."""
        self.chain[slot] = self.heads.get(key, -1)
        self.heads[key] = position

    def unlink(self, key: int, position: int) -> None:
        """``position`` is evicted: forget ``key`` if that was its latest occurrence."""
        if self.heads.get(key) == position:
            del self.heads[key]

    def recent(self, key: int, first: int, count: int) -> list[int]:
        """The latest ``count`` positions of ``key`` that are not before ``first``, newest first."""
        found: list[int] = []
        position = self.heads.get(key, -1)
        chain, size = self.chain, self.size
        while position >= first and len(found) < count:
            found.append(position)
            position = chain[position % size]
        return found


def _int64s(size: int) -> array:
    """A zeroed int64 array of ``size`` entries."""
    return array("q", bytes(8 * size))


FILE_FORMAT = "lookahead-server n-gram memory"
FILE_VERSION = 1


class MemoryFileError(ValueError):
    """A memory file that cannot be read, is not one, or was saved for another vocabulary."""


def vocabulary_id(vocabulary: Mapping[str, int]) -> str:
    """A short id of a tokenizer's vocabulary (token text -> id): memory files are only valid for the same one.

    >>> vocabulary_id({"a": 0, "b": 1}) == vocabulary_id({"b": 1, "a": 0}) != vocabulary_id({"a": 1, "b": 0})
    True
    """
    digest = hashlib.sha256()
    for text, token in sorted(vocabulary.items(), key=lambda item: item[1]):
        digest.update(f"{token}\t{text}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def save_memory(memory: NGramMemory, path: str | Path, vocabulary: str) -> int:
    """Write ``memory``'s documents to ``path`` under the vocabulary id ``vocabulary``; return how many."""
    path = Path(path)
    documents = memory.snapshot()
    header = {"format": FILE_FORMAT, "version": FILE_VERSION, "vocabulary": vocabulary, "tokens": len(memory)}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    with gzip.open(partial, "wt", encoding="utf-8") as sink:
        json.dump({**header, "documents": documents}, sink, separators=(",", ":"))
    partial.replace(path)
    return len(documents)


def load_memory(memory: NGramMemory, path: str | Path, vocabulary: str) -> int:
    """Add the documents saved in ``path`` to ``memory`` (oldest first, evicting as ``add`` does); return how
    many were read. Raises ``MemoryFileError`` (nothing added) when the file cannot be read or parsed, is not a
    memory file of this version, was saved under another vocabulary id, or holds anything but lists of token
    ids."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as source:
            saved = json.load(source)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MemoryFileError(f"cannot read the memory file {path}: {error}") from error
    if not isinstance(saved, dict) or saved.get("format") != FILE_FORMAT or saved.get("version") != FILE_VERSION:
        raise MemoryFileError(f"{path} is not a version-{FILE_VERSION} memory file")
    if saved.get("vocabulary") != vocabulary:
        raise MemoryFileError(f"{path} was saved for another vocabulary ({saved.get('vocabulary')}, not {vocabulary})")
    documents = saved.get("documents")
    valid = isinstance(documents, list) and all(
        isinstance(document, list) and all(type(token) is int and 0 <= token < TOKEN_LIMIT for token in document)
        for document in documents
    )
    if not valid:
        raise MemoryFileError(f"{path}: documents must be lists of token ids")
    memory.add_documents(documents)
    return len(documents)
