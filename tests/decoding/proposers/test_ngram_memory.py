"""The server-wide n-gram memory: eviction, document boundaries, ranking, limits, against a brute-force reference."""

from __future__ import annotations

import random
import time

import pytest

from decoding.proposers.ngram_memory import MemoryFileError, NGramMemory, load_memory, save_memory, vocabulary_id


def reference(documents: list[list[int]], tokens: list[int], length: int, limit: int, min_match: int) -> list[tuple]:
    """``NGramMemory.candidates`` by brute force over the stored documents (oldest first), every occurrence."""
    ranked = []
    position = 0
    for document in documents:
        for index, token in enumerate(document):
            if token != tokens[-1] or index + 1 >= len(document):
                continue
            match = 0
            while (match < NGramMemory.MAX_MATCH and index - match - 1 >= 0 and len(tokens) - match - 2 >= 0
                   and document[index - match - 1] == tokens[-match - 2]):
                match += 1
            if match >= min_match:
                available = min(length, len(document) - index - 1)
                continuation = tuple(document[index + 1 : index + 1 + available])
                ranked.append((min(match, NGramMemory.STRONG_MATCH), available, match, position + index, continuation))
        position += len(document)
    found: list[tuple] = []
    for *_, continuation in sorted(ranked, reverse=True):
        if not any(chosen[: len(continuation)] == continuation for chosen in found):
            found.append(continuation)
            if len(found) == limit:
                break
    return found


def stored_documents(added: list[list[int]], max_tokens: int) -> list[list[int]]:
    """What the memory must hold after ``added``: the newest documents that fit, the newest one's tail at most."""
    kept: list[list[int]] = []
    for document in added:
        document = document[-max_tokens:]
        if not document:
            continue
        kept.append(document)
        while sum(map(len, kept)) > max_tokens:
            kept.pop(0)
    return kept


def memory_of(*documents: list[int], max_tokens: int = 100) -> NGramMemory:
    memory = NGramMemory(max_tokens)
    for document in documents:
        memory.add(document)
    return memory


def test_rejects_an_empty_memory():
    with pytest.raises(ValueError):
        NGramMemory(0)


def test_clear_forgets_every_document():
    memory = memory_of([1, 2, 3, 4], [9, 2, 3, 5])
    memory.clear()
    assert (len(memory), memory.documents) == (0, 0)
    assert memory.candidates([7, 2, 3], length=2, limit=2, min_match=0) == []
    memory.add([1, 2, 3, 6])  # usable again, with the same bounds
    assert memory.candidates([7, 2, 3], length=2, limit=2, min_match=0) == [(6,)]


def test_empty_document_stores_nothing():
    memory = memory_of([], [1, 2])
    assert (len(memory), memory.documents) == (2, 1)


def test_eviction_keeps_the_newest_documents_within_the_bound():
    rng = random.Random(0)
    memory, added = NGramMemory(50), []
    for _ in range(200):
        document = [rng.randrange(1000) for _ in range(rng.randint(0, 30))]
        memory.add(document)
        added.append(document)
        expected = stored_documents(added, 50)
        assert len(memory) == sum(map(len, expected)) <= 50
        assert memory.documents == len(expected)


def test_a_document_longer_than_the_memory_keeps_its_tail():
    memory = memory_of([1, 2, 3, 4, 5, 6, 7, 8], max_tokens=5)
    assert (len(memory), memory.documents) == (5, 1)
    assert memory.candidates([4, 5], length=3, limit=4) == [(6, 7, 8)]
    assert memory.candidates([2, 3], length=3, limit=4) == []  # evicted
    assert memory.candidates([3, 4], length=3, limit=4) == []  # 4 is the first kept token: no 3 before it


def test_evicted_documents_are_never_offered():
    memory = memory_of([1, 2, 3], [4, 5, 6], max_tokens=6)
    memory.add([7, 8])
    assert memory.candidates([1, 2], length=2, limit=4, min_match=0) == []
    assert memory.candidates([4, 5], length=2, limit=4) == [(6,)]


def test_matches_and_continuations_stay_inside_their_document():
    memory = memory_of([1, 2], [3, 4])
    assert memory.candidates([2, 3], length=2, limit=4) == []  # "2 3" spans two documents
    assert memory.candidates([2, 3], length=2, limit=4, min_match=0) == [(4,)]
    assert memory.candidates([0, 1], length=3, limit=4, min_match=0) == [(2,)]  # stops at the document's end
    assert memory.candidates([9, 4], length=3, limit=4, min_match=0) == []  # nothing follows a document's last token


def test_documents_across_the_ring_boundary():
    memory = memory_of([0] * 7, [1, 2, 3, 4, 5, 6], max_tokens=10)  # the second one wraps around the ring
    assert memory.documents == 1
    assert memory.candidates([1, 2, 3, 4], length=4, limit=2) == [(5, 6)]
    assert memory.candidates([9, 1, 2], length=4, limit=2) == [(3, 4, 5, 6)]


@pytest.mark.parametrize(
    "documents, tokens, length, expected",
    [
        # a stronger match beats a longer continuation
        ([[9, 1, 2, 30, 31, 32], [7, 1, 2, 40]], [7, 1, 2], 3, [(40,), (30, 31, 32)]),
        # matches of 5+ count alike: then the longer continuation wins
        ([[0, 1, 2, 3, 4, 5, 6, 7, 50], [2, 3, 4, 5, 6, 7, 60, 61]], [1, 2, 3, 4, 5, 6, 7], 2, [(60, 61), (50,)]),
        # equal strength and continuation length: the longer match wins, though older
        ([[1, 2, 3, 4, 5, 6, 7, 50], [2, 3, 4, 5, 6, 7, 60]], [1, 2, 3, 4, 5, 6, 7], 1, [(50,), (60,)]),
        # all else equal: the most recent first
        ([[1, 2, 50], [1, 2, 60]], [1, 2], 1, [(60,), (50,)]),
    ],
)
def test_ranking(documents, tokens, length, expected):
    assert memory_of(*documents).candidates(tokens, length, limit=4) == expected


def test_limit_length_and_min_match():
    memory = memory_of([9, 1, 2, 30, 31, 32], [7, 1, 2, 40], [1, 2, 50])
    assert memory.candidates([7, 1, 2], length=3, limit=1) == [(40,)]
    assert memory.candidates([7, 1, 2], length=1, limit=4) == [(40,), (50,), (30,)]  # 50 and 30: equal, 50 newer
    assert memory.candidates([7, 1, 2], length=3, limit=4, min_match=2) == [(40,)]
    assert memory.candidates([7, 1, 2], length=3, limit=4, min_match=3) == []
    assert memory.candidates([7, 1, 2], length=3, limit=0) == []
    assert memory.candidates([7, 1, 2], length=0, limit=4) == []
    assert memory.candidates([], length=3, limit=4) == []
    assert memory.candidates([2], length=3, limit=4) == []  # min_match 1 needs a token before the last
    assert memory.candidates([2], length=1, limit=4, min_match=0) == [(50,), (40,), (30,)]


def test_candidates_are_distinct_and_prefixes_of_chosen_ones_are_skipped():
    memory = memory_of([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4])
    assert memory.candidates([1, 2], length=2, limit=4) == [(3, 4)]
    memory = memory_of([8, 1, 2, 3], [1, 2, 3, 4])  # a longer continuation after a shorter one is kept
    assert memory.candidates([8, 1, 2], length=2, limit=4) == [(3,), (3, 4)]


def test_only_the_most_recent_occurrences_are_searched():
    memory = NGramMemory(100, max_occurrences=2)
    for follower in (50, 60, 70):
        memory.add([1, 2, follower])
    assert memory.candidates([1, 2], length=1, limit=4) == [(70,), (60,)]
    assert memory.candidates([2], length=1, limit=4, min_match=0) == [(70,), (60,)]


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_brute_force_reference(seed):
    rng = random.Random(seed)
    max_tokens = rng.choice([7, 20, 64])
    memory, added = NGramMemory(max_tokens, max_occurrences=10**6), []
    for _ in range(rng.randint(1, 12)):
        document = [rng.randrange(4) for _ in range(rng.randint(0, 25))]
        memory.add(document)
        added.append(document)
    stored = stored_documents(added, max_tokens)
    for _ in range(30):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        length, limit, min_match = rng.randint(1, 6), rng.randint(1, 5), rng.randint(0, 6)
        expected = reference(stored, tokens, length, limit, min_match)
        assert memory.candidates(tokens, length, limit, min_match) == expected, (tokens, length, limit, min_match)


def test_index_keys_never_outnumber_stored_tokens():
    rng = random.Random(1)
    memory = NGramMemory(300)
    for _ in range(100):
        memory.add([rng.randrange(1000) for _ in range(rng.randint(1, 40))])
        assert len(memory._by_token.heads) <= len(memory) and len(memory._by_pair.heads) < len(memory)


def test_token_ids_outside_the_range_are_refused():
    memory = NGramMemory(10)
    with pytest.raises(ValueError):
        memory.add([1, -1])
    with pytest.raises(ValueError):
        memory.add([2**32])
    assert (len(memory), memory.candidates([-1], 1, 1, min_match=0)) == (0, [])


def test_lookup_time_in_a_full_memory():
    """Fill 100k tokens of Zipf-distributed text and time lookups; printed (run with -s), not asserted."""
    rng = random.Random(0)
    vocab = 49152
    weights = [1 / (rank + 1) ** 1.1 for rank in range(vocab)]
    memory, documents = NGramMemory(100_000), []
    started = time.perf_counter()
    while len(memory) < 99_000:
        documents.append(rng.choices(range(vocab), weights, k=rng.randint(50, 300)))
        memory.add(documents[-1])
    filled = time.perf_counter() - started
    queries = [rng.choices(range(vocab), weights, k=64) for _ in range(200)]  # fresh text
    queries += [document[: rng.randint(10, 40)] for document in rng.sample(documents, 200)]  # a repeated start
    queries.append([1, 2, 3, 4, 5, 6, 7, 8] * 4)
    started = time.perf_counter()
    results = [memory.candidates(query, length=8, limit=5) for query in queries]
    per_lookup = (time.perf_counter() - started) / len(queries)
    print(f"\nNGramMemory: {len(memory)} tokens in {memory.documents} documents filled in {filled * 1e3:.0f} ms; "
          f"{per_lookup * 1e6:.1f} us per lookup ({sum(map(bool, results))}/{len(results)} found candidates)")
    assert len(memory) <= 100_000


def test_documents_list_what_is_stored_oldest_first_after_evictions():
    memory = NGramMemory(max_tokens=10)
    for document in ([1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]):
        memory.add(document)
    assert memory.snapshot() == [[4, 5, 6, 7], [8, 9, 10, 11, 12]]  # the first no longer fits
    wrapped = NGramMemory(max_tokens=10)
    for document in memory.snapshot():
        wrapped.add(document)
    assert wrapped.snapshot() == memory.snapshot()


def test_a_saved_memory_loads_back_into_a_new_one_with_the_same_candidates(tmp_path):
    rng = random.Random(3)
    memory = NGramMemory(max_tokens=500)
    for _ in range(40):  # more than fits: the ring has wrapped and evicted before saving
        memory.add([rng.randrange(30) for _ in range(rng.randrange(1, 40))])
    path = tmp_path / "memory.json.gz"
    assert save_memory(memory, path, "vocab-a") == memory.documents
    restored = NGramMemory(max_tokens=500)
    assert load_memory(restored, path, "vocab-a") == memory.documents
    assert restored.snapshot() == memory.snapshot() and len(restored) == len(memory)
    for _ in range(50):
        tokens = [rng.randrange(30) for _ in range(6)]
        for min_match in (0, 1, 2):
            assert restored.candidates(tokens, 8, 4, min_match) == memory.candidates(tokens, 8, 4, min_match)


def test_loading_into_a_smaller_memory_keeps_the_newest_documents(tmp_path):
    memory = NGramMemory(max_tokens=100)
    for start in range(0, 60, 10):
        memory.add(list(range(start, start + 10)))
    save_memory(memory, tmp_path / "m.gz", "v")
    small = NGramMemory(max_tokens=25)
    assert load_memory(small, tmp_path / "m.gz", "v") == 6  # read all six, kept what fits
    assert small.snapshot() == [list(range(40, 50)), list(range(50, 60))]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read"),  # not gzip at all
        ({"format": "something else", "version": 1}, "not a version-1 memory file"),
        ({"format": "lookahead-server n-gram memory", "version": 1, "vocabulary": "other", "documents": []},
         "another vocabulary"),
        ({"format": "lookahead-server n-gram memory", "version": 1, "vocabulary": "v", "documents": [[1, -2]]},
         "lists of token ids"),
        ({"format": "lookahead-server n-gram memory", "version": 1, "vocabulary": "v", "documents": [["a"]]},
         "lists of token ids"),
    ],
)
def test_a_bad_memory_file_is_refused_and_adds_nothing(tmp_path, content, message):
    import gzip
    import json

    path = tmp_path / "bad.gz"
    if content is None:
        path.write_text("plain text")
    else:
        with gzip.open(path, "wt") as sink:
            json.dump(content, sink)
    memory = NGramMemory(max_tokens=50)
    memory.add([1, 2, 3])
    with pytest.raises(MemoryFileError, match=message):
        load_memory(memory, path, "v")
    assert memory.snapshot() == [[1, 2, 3]]


def test_a_missing_memory_file_is_a_memory_file_error(tmp_path):
    with pytest.raises(MemoryFileError, match="cannot read"):
        load_memory(NGramMemory(10), tmp_path / "absent.gz", "v")


def test_vocabulary_id_depends_on_every_token_and_id():
    vocabulary = {"a": 0, "b": 1, "c": 2}
    assert vocabulary_id(vocabulary) == vocabulary_id(dict(reversed(list(vocabulary.items()))))
    assert vocabulary_id(vocabulary) != vocabulary_id({"a": 0, "b": 1, "d": 2})
    assert vocabulary_id(vocabulary) != vocabulary_id({"a": 0, "b": 2, "c": 1})
