"""The n-gram pool: insertion, refresh, eviction, sequence scanning (table tests)."""

from __future__ import annotations

import pytest

from decoding.proposers.pool import ContextIndex, NGramPool


@pytest.mark.parametrize(
    "inserts, key, expected",
    [
        ([(1, (2, 3))], 1, [(2, 3)]),
        ([(1, (2, 3)), (1, (4, 5))], 1, [(4, 5), (2, 3)]),
        ([(1, (2, 3)), (1, (4, 5)), (1, (2, 3))], 1, [(2, 3), (4, 5)]),  # refreshed, not duplicated
        ([(1, (2, 3)), (1, (4, 5)), (1, (6, 7))], 1, [(6, 7), (4, 5)]),  # oldest evicted at capacity 2
        ([(1, (2, 3))], 9, []),
    ],
)
def test_pool_table(inserts, key, expected):
    pool = NGramPool(ngram_length=2, capacity=2)
    for k, ngram in inserts:
        pool.add(k, ngram)
    assert pool.candidates(key) == expected


def test_candidates_limit_and_zero_capacity():
    pool = NGramPool(ngram_length=1, capacity=3)
    for token in (4, 5, 6):
        pool.add(1, (token,))
    assert pool.candidates(1, limit=2) == [(6,), (5,)]
    empty = NGramPool(ngram_length=1, capacity=0)
    empty.add(1, (2,))
    assert len(empty) == 0


@pytest.mark.parametrize("ngram", [(), (2, 3, 4, 5)])
def test_add_rejects_empty_or_too_long(ngram):
    with pytest.raises(ValueError):
        NGramPool(ngram_length=3, capacity=1).add(1, ngram)


def test_shorter_ngram_covered_by_a_stored_one_is_left_out():
    pool = NGramPool(ngram_length=3, capacity=4)
    pool.add(1, (2, 3, 4))
    pool.add(1, (2, 3))  # a prefix of (2, 3, 4): verifies nothing new
    pool.add(1, (2, 5))
    pool.add(1, (9,))
    assert pool.candidates(1) == [(9,), (2, 5), (2, 3, 4)]
    pool.add(1, (2, 5, 6))  # a full n-gram is stored even when a shorter one is its prefix
    assert pool.candidates(1)[0] == (2, 5, 6)


def test_add_chains_keys_every_suffix_by_the_token_before_it():
    pool = NGramPool(ngram_length=3, capacity=2)
    pool.add_chains([(1, (2, 3, 4)), (7, (8, 3, 4)), (5, (2, 3, 6))])
    assert pool.candidates(1) == [(2, 3, 4)]
    assert pool.candidates(5) == [(2, 3, 6)]
    assert pool.candidates(2) == [(3, 6), (3, 4)]
    assert pool.candidates(8) == [(3, 4)]
    assert pool.candidates(3) == [(6,), (4,)]  # (4,) twice: refreshed, not duplicated
    assert len(pool) == 8


def test_add_sequence_inserts_each_ngram_once_across_appends():
    pool = NGramPool(ngram_length=2, capacity=8)
    tokens = [1, 2, 3]
    start = pool.add_sequence(tokens)
    assert pool.candidates(1) == [(2, 3)] and start == 1
    tokens += [1, 2, 4]
    start = pool.add_sequence(tokens, start)
    assert start == 4
    assert pool.candidates(1) == [(2, 4), (2, 3)]
    assert pool.candidates(2) == [(3, 1)]
    assert pool.candidates(3) == [(1, 2)]
    assert len(pool) == 4


@pytest.mark.parametrize(
    "tokens, length, limit, expected",
    [
        ([1, 2, 3, 9, 2, 3, 7, 1, 2], 2, 2, [(3, 9), (3, 7)]),  # "1 2" matched before the first 2 only
        ([5, 2, 3, 9, 2, 3, 7, 5, 2], 2, 1, [(3, 9)]),  # the longest match wins the only slot
        ([4, 2, 8, 2, 6, 2], 1, 3, [(6,), (8,)]),  # equal matches: most recent first; the last 2 has no next
        ([1, 2, 3, 1, 2], 3, 2, [(3, 1, 2)]),  # a continuation may run up to last itself
        ([1, 2, 3, 1, 2], 4, 2, []),  # but never past it
        ([7, 7, 7, 7], 1, 4, [(7,)]),  # duplicates collapse
        ([1, 2, 3, 1], 2, 0, []),
    ],
)
def test_context_index_ranks_by_matching_context(tokens, length, limit, expected):
    index = ContextIndex()
    index.extend(tokens)
    assert index.candidates(tokens, length, limit) == expected


def test_context_index_skips_unindexed_positions():
    tokens = [1, 2, 3, 1, 2, 4, 1]
    index = ContextIndex()
    index.skip_to(3)  # the prompt (first 3 tokens) is not a source
    index.extend(tokens, upto=6)
    assert index.candidates(tokens, 2, 4) == [(2, 4)]


def test_prefix_counts_keep_the_pool_as_a_scan_of_its_entries_would():
    """The pool's covered-check by prefix counts (with evictions) stores exactly what scanning its entries did."""
    import random
    from collections import OrderedDict

    from decoding.proposers.pool import NGramPool, covered

    def reference_add(table, key, ngram, length, capacity):
        entries = table.setdefault(key, OrderedDict())
        if ngram in entries:
            entries.move_to_end(ngram)
            return
        if len(ngram) < length and covered(ngram, entries):
            return
        entries[ngram] = None
        if len(entries) > capacity:
            entries.popitem(last=False)

    rng = random.Random(3)
    for capacity in (1, 2, 5):
        pool, table = NGramPool(4, capacity), {}
        for _ in range(3000):
            key, ngram = rng.randrange(3), tuple(rng.randrange(3) for _ in range(rng.randint(1, 4)))
            pool.add(key, ngram)
            reference_add(table, key, ngram, 4, capacity)
        for key in range(3):
            assert pool.candidates(key) == list(reversed(table.get(key, {})))
