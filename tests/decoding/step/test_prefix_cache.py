"""The prefix cache: a conversation decodes the same tokens (and logprobs) with the cache on and off, greedy and
seeded, lookahead on and off, batched, through the static step's KV pool; the cache stays within its budget, evicts
least recently used first, never touches a running decode, and honours the opt-out."""

from __future__ import annotations

import pytest
import torch

from decoding.batch import BatchEngine, BatchPolicy
from decoding.errors import ContextLengthError, EmptyPromptError
from decoding.forward.kv_cache import KVPool, SlotCache, new_cache
from decoding.forward.static import StaticStep
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.proposers.pool import ContextIndex
from decoding.step.prefix_cache import PrefixCache, common_prefix
from decoding.step.stream import DecodeStream
from tests.conftest import tiny_llama

CPU_LIKE = LookaheadConfig(1, 3, 2, lazy_window=True, break_even=1.5, copy_length=8, copy_min_match=2)
CONFIGS = [None, LookaheadConfig(4, 4, 4), CPU_LIKE, LookaheadConfig(3, 4, 3, copy_length=12, copy_min_match=1,
                                                                      copy_candidates=3)]
SYSTEM = [1, 5, 7, 9, 5, 7, 9, 5, 7, 3, 2]
USER_TURNS = [[10, 11, 12, 13], [20, 21, 5, 7, 9], [30, 31, 32], [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def drain(engine: BatchEngine) -> dict:
    """Step ``engine`` until it is idle: per request id, its tokens, its steps' logprobs and cached tokens."""
    outputs: dict = {}
    for _ in range(5000):
        if not engine.has_work:
            return outputs
        for request_id, step in engine.step():
            assert not isinstance(step, BaseException), step
            tokens, logprobs, cached = outputs.setdefault(request_id, ([], [], [0]))
            tokens.extend(step.token_ids)
            logprobs.extend(step.logprobs or [])
            cached[0] += step.cached_tokens
    raise AssertionError("the engine never went idle")


def converse(engine: BatchEngine, configs, sampling=SamplingParams(), turns=USER_TURNS, max_tokens: int = 24,
             conversations: int = 1, **add) -> list[list[tuple]]:
    """``conversations`` chats stepped side by side, turn by turn: each prompt is the last prompt, the last
    output and the next user turn. Per conversation, per turn: (tokens, logprobs, cached tokens)."""
    histories = [[*SYSTEM, 40 + index] for index in range(conversations)]
    results: list[list[tuple]] = [[] for _ in range(conversations)]
    for turn, user in enumerate(turns):
        for index in range(conversations):
            histories[index] += user
            engine.add((index, turn), list(histories[index]), StopCriteria(max_tokens), sampling,
                       configs[turn % len(configs)], **add)
        outputs = drain(engine)
        for index in range(conversations):
            tokens, logprobs, cached = outputs[(index, turn)]
            results[index].append((tokens, logprobs, cached[0]))
            histories[index] += tokens
    return results


def on(tokens: int = 4096, **policy) -> BatchPolicy:
    return BatchPolicy(prefix_cache_tokens=tokens, **policy)


def texts(results) -> list[list[list[int]]]:
    return [[turn[0] for turn in conversation] for conversation in results]


def test_common_prefix_table():
    assert common_prefix([], [1]) == 0
    assert common_prefix(list(range(200)), list(range(150)) + [0]) == 150
    assert common_prefix(list(range(200)), list(range(200)), limit=199) == 199
    assert common_prefix([1, 2], [3]) == 0


@pytest.mark.parametrize("config", CONFIGS, ids=["autoregressive", "w4", "cpu-preset", "copies"])
def test_a_conversation_decodes_the_same_with_the_cache_on_and_off(model, config):
    reference = converse(BatchEngine(model), [config])
    engine = BatchEngine(model, on())
    cached = converse(engine, [config])
    assert texts(cached) == texts(reference)
    assert cached[0][0][2] == 0 and all(turn[2] > 0 for turn in cached[0][1:])
    stats = engine.prefix_cache_stats()
    assert stats.hits >= len(USER_TURNS) - 1 and stats.cached_tokens > 0 and stats.entries == 1


def test_every_later_turn_reuses_the_whole_last_conversation(model):
    """Turn k's prompt starts with turn k-1's prompt and output: all of it but the last output token is reused
    (that token's KV was never computed: it is the ``last`` the next step would have run)."""
    engine = BatchEngine(model, on())
    results = converse(engine, [None])
    held = len(SYSTEM) + 1  # the tokens of the conversation so far
    for turn, (tokens, _, cached) in enumerate(results[0]):
        assert cached == (held - 1 if turn else 0)  # all of it but the last output token
        held += len(USER_TURNS[turn]) + len(tokens)


def test_seeded_sampling_and_logprobs_are_the_same_with_the_cache(model):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=7, top_logprobs=2)
    configs = [CPU_LIKE, None, LookaheadConfig(4, 4, 4)]
    reference = converse(BatchEngine(model), configs, sampling)
    cached = converse(BatchEngine(model, on()), configs, sampling)
    assert texts(cached) == texts(reference)
    for want, got in zip(reference[0], cached[0], strict=True):
        assert [entry.token_id for entry in got[1]] == [entry.token_id for entry in want[1]]
        assert [entry.logprob for entry in got[1]] == pytest.approx([entry.logprob for entry in want[1]], abs=1e-4)
    assert all(turn[2] > 0 for turn in cached[0][1:])


def test_batched_conversations_and_same_prompts_share_the_cache(model):
    """Three chats stepped side by side (their prompts also match each other's system prompt), each turn of each
    decoded as it is with the cache off."""
    reference = converse(BatchEngine(model), CONFIGS, conversations=3)
    engine = BatchEngine(model, on())
    cached = converse(engine, CONFIGS, conversations=3)
    assert texts(cached) == texts(reference)
    assert all(turn[2] > 0 for conversation in cached for turn in conversation[1:])


def test_a_running_prompt_is_a_source_and_is_never_disturbed(model):
    """n > 1 as the server runs it (the same prompt added twice), and a third request added while they run, reusing
    the first one's prefilled prompt; each decodes as it does alone; then a tiny budget evicts all the time."""
    prompt = [*SYSTEM, 3, 4, 5, 6, 7, 8]
    alone = drain_one(BatchEngine(model), prompt, CPU_LIKE)
    engine = BatchEngine(model, on(16))
    for request_id in ("a", "b"):
        engine.add(request_id, prompt, StopCriteria(24), SamplingParams(), CPU_LIKE)
    first = engine.step()  # both prefill in one forward
    assert all(step.cached_tokens == 0 for _, step in first)
    engine.add("c", prompt, StopCriteria(24), SamplingParams(), CPU_LIKE)
    for index in range(6):  # short requests of other prompts finish and evict each other while a, b, c run
        engine.add(f"short{index}", [50 + index, *range(10, 30)], StopCriteria(2), SamplingParams(), None)
    outputs = drain(engine)
    assert outputs["c"][2][0] == len(prompt) - 1  # from a running decode's prompt
    tokens = {request_id: [*(step.token_ids for request_id_, step in first if request_id_ == request_id)]
              for request_id in ("a", "b")}
    for request_id in ("a", "b"):
        assert tokens[request_id][0] + outputs[request_id][0] == alone
    assert outputs["c"][0] == alone
    stats = engine.prefix_cache_stats()
    assert stats.tokens <= 16 and stats.evictions >= 1


def drain_one(engine: BatchEngine, prompt, config, max_tokens: int = 24) -> list[int]:
    engine.add("one", prompt, StopCriteria(max_tokens), SamplingParams(), config)
    return drain(engine)["one"][0]


def test_eviction_keeps_the_budget_and_drops_the_least_recently_used(model):
    engine = BatchEngine(model, on(64))
    prompts = [[index, *range(20, 40)] for index in range(1, 5)]  # distinct first tokens: no entry holds another
    for prompt in prompts[:2]:
        drain_one(engine, prompt, None, max_tokens=8)
    cache = engine.prefix_cache
    assert cache.stats().entries == 2
    assert cache.lookup([*prompts[0], 1]).tokens == len(prompts[0])  # prompt 0 used: prompt 1 is the LRU
    drain_one(engine, prompts[2], None, max_tokens=8)
    stats = cache.stats()
    assert stats.tokens <= 64 and stats.evictions == 1
    assert cache.lookup([*prompts[1], 1]) is None and cache.lookup([*prompts[0], 1]) is not None
    assert stats.bytes == sum(entry.nbytes for entry in cache._entries.values())


def test_an_entry_longer_than_the_budget_keeps_its_start(model):
    engine = BatchEngine(model, on(10))
    drain_one(engine, list(range(1, 30)), None, max_tokens=4)
    assert engine.prefix_cache.stats().tokens == 10
    assert engine.prefix_cache.lookup(list(range(1, 30))).tokens == 10


def test_a_longer_entry_replaces_the_one_it_holds(model):
    engine = BatchEngine(model, on())
    converse(engine, [None], turns=USER_TURNS[:3])
    assert engine.prefix_cache.stats().entries == 1 and engine.prefix_cache.stats().evictions == 0


def test_the_opt_out_neither_reads_nor_leaves_kv(model):
    engine = BatchEngine(model, on())
    results = converse(engine, [CPU_LIKE], cache_prompt=False)
    assert all(turn[2] == 0 for turn in results[0])
    assert engine.prefix_cache.stats().entries == 0 and engine.prefix_cache.stats().hits == 0


def test_prompt_logprobs_read_every_prompt_row(model):
    engine = BatchEngine(model, on())
    drain_one(engine, list(range(1, 20)), None)
    engine.add("p", list(range(1, 25)), StopCriteria(4), SamplingParams(prompt_logprobs=1), None)
    assert drain(engine)["p"][2][0] == 0


def test_bad_and_huge_prompts_are_refused_without_a_lookup(model):
    engine = BatchEngine(model, on())
    drain_one(engine, list(range(1, 20)), None)
    with pytest.raises(EmptyPromptError):
        engine.add("empty", [], StopCriteria(4))
    with pytest.raises(ContextLengthError):
        engine.add("huge", list(range(1, 20)) * 400, StopCriteria(4))
    assert engine.prefix_cache.stats().hits == 0 and not engine.has_work
    engine.add("one", [5], StopCriteria(4))  # a one-token prompt has nothing to reuse
    assert drain(engine)["one"][2][0] == 0


def test_the_conversation_through_the_static_steps_kv_pool(model):
    """The hit is copied into the acquired pool row; what a pool row leaves is flushed first."""
    reference = converse(BatchEngine(model), CONFIGS, conversations=2)
    static = StaticStep(model, KVPool(model, 4, 512, scratch_tokens=256), mode="eager")
    engine = BatchEngine(model, on(), static=static)
    cached = converse(engine, CONFIGS, conversations=2)
    assert texts(cached) == texts(reference)
    assert all(turn[2] > 0 for conversation in cached for turn in conversation[1:])
    assert static.runs > 0 and static.pool.free == 4


def test_the_restored_copy_index_equals_a_fresh_one():
    tokens = [1, 2, 3, 1, 2, 4, 1, 5, 2]
    whole = ContextIndex()
    whole.extend(tokens)
    for length in range(len(tokens) + 1):
        fresh = ContextIndex()
        fresh.extend(tokens, length)
        restored = whole.prefix(length)
        assert restored._positions == fresh._positions and restored.dense == length
        restored.extend(tokens)
        assert restored._positions == whole._positions
    gapped = ContextIndex()
    gapped.skip_to(4)
    gapped.extend(tokens)
    assert gapped.dense == 0
    with pytest.raises(ValueError):
        gapped.prefix(2)


def test_snapshot_and_load_prefix_round_trip(model):
    stream = DecodeStream(model, [1, 2, 3, 4, 5], StopCriteria(4))
    next(stream)  # the prefill
    cache = stream.sequence.cache
    assert cache.shared and cache.length == 5
    kv = cache.snapshot(4)
    copy = new_cache(model, 16)
    copy.load_prefix(kv)
    assert copy.length == 4 and torch.equal(copy.view(4), cache.view(4))
    with pytest.raises(ValueError):
        copy.load_prefix(kv)  # not empty
    assert cache.snapshot(0) is None and cache.snapshot(6) is None
    assert PrefixCache(8).store([1, 2], SlotCache(2, 4)) is False  # nothing computed: nothing to copy
