"""Batched steps: a stream's greedy tokens do not depend on its neighbours, budgets or chunked prefill; the
``BatchEngine`` adds, steps, cancels and drops finished or failed requests by id."""

from __future__ import annotations

from dataclasses import replace

import pytest

from decoding.batch import BatchEngine, BatchPolicy, step_batch
from decoding.errors import InvalidParameterError
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.payoff import PayoffGuard
from decoding.proposers.ngram_memory import NGramMemory
from decoding.step.stream import (
    DecodeStream,
    StepCounts,
    StepStats,
    generate_autoregressive,
    generate_lookahead,
)
from tests.decoding.stubs import StubLM, cycle_model

PROMPTS = [
    [1, 5, 7, 9, 5, 7, 9, 5, 7, 3, 2, 5, 7],
    [10, 11, 12, 13, 10, 11, 12, 13, 10, 11],
    [42],
    [3, 3, 3, 3, 3, 3, 8, 3, 3],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
    [2, 4, 6, 2, 4, 6, 8, 2, 4, 9, 2, 4],
]
CONFIGS = [
    LookaheadConfig(4, 4, 4),
    None,
    LookaheadConfig(1, 5, 3, lazy_window=True, break_even=0.5, copy_length=10),
    LookaheadConfig(7, 5, 7),
    LookaheadConfig(2, 3, 2, align_window=False),
    LookaheadConfig(3, 4, 3, copy_length=12, copy_min_match=1, copy_candidates=3),
]


def tokens_of(steps) -> list[int]:
    return [token for step in steps for token in step.token_ids]


def run_batch(streams, policy: BatchPolicy, join_at: dict[int, int] | None = None) -> list[list[int]]:
    """Step ``streams`` together until all finish; stream i joins at iteration ``join_at[i]`` (default 0)."""
    join_at = join_at or {}
    outputs: list[list[int]] = [[] for _ in streams]
    iteration = 0
    while not all(stream.finished for stream in streams):
        active = [i for i, s in enumerate(streams) if not s.finished and join_at.get(i, 0) <= iteration]
        for index, step in zip(active, step_batch([streams[i] for i in active], policy), strict=True):
            assert not isinstance(step, BaseException), step
            if step is not None:
                outputs[index].extend(step.token_ids)
        iteration += 1
        assert iteration < 2000
    return outputs


def make_stream(model, prompt, config, sampling=SamplingParams(), max_tokens=40):
    stop = StopCriteria(max_tokens)
    if config is None:
        return generate_autoregressive(model, prompt, stop, sampling)
    return generate_lookahead(model, prompt, stop, sampling, config)


@pytest.mark.parametrize(
    "policy",
    [
        BatchPolicy(),
        BatchPolicy(max_step_tokens=8, prefill_chunk=3),
        BatchPolicy(max_step_tokens=1000, prefill_chunk=1000),
    ],
    ids=["default", "tight", "roomy"],
)
def test_batched_greedy_equals_each_stream_alone_with_mixed_configs(tiny_model, policy):
    alone = [tokens_of(make_stream(tiny_model, p, c)) for p, c in zip(PROMPTS, CONFIGS, strict=True)]
    streams = [make_stream(tiny_model, p, c) for p, c in zip(PROMPTS, CONFIGS, strict=True)]
    assert run_batch(streams, policy, join_at={1: 3, 3: 7, 4: 20}) == alone


def test_greedy_streams_are_unaffected_by_sampling_neighbours(tiny_model):
    greedy_alone = tokens_of(make_stream(tiny_model, PROMPTS[0], CONFIGS[0]))
    hot = SamplingParams(temperature=1.0, seed=7)
    streams = [
        make_stream(tiny_model, PROMPTS[0], CONFIGS[0]),
        make_stream(tiny_model, PROMPTS[1], CONFIGS[3], hot),
        make_stream(tiny_model, PROMPTS[3], None, SamplingParams(temperature=0.7, top_p=0.9, seed=3)),
    ]
    assert run_batch(streams, BatchPolicy())[0] == greedy_alone


def test_seeded_sampling_is_reproducible_alone_and_in_the_same_batch(tiny_model):
    """Seeded lookahead sampling repeats exactly alone; in a batch the budgets (so the draws) depend on the
    neighbours, but the same batch repeats exactly too."""
    hot = SamplingParams(temperature=1.0, top_k=20, seed=11)
    config = LookaheadConfig(4, 4, 4)
    alone = [run_batch([make_stream(tiny_model, PROMPTS[1], config, hot)], BatchPolicy())[0] for _ in range(2)]
    assert alone[0] == alone[1] == tokens_of(make_stream(tiny_model, PROMPTS[1], config, hot))

    def batch() -> list[list[int]]:
        neighbours = [make_stream(tiny_model, p, c) for p, c in zip(PROMPTS[2:], CONFIGS[2:], strict=True)]
        return run_batch([make_stream(tiny_model, PROMPTS[1], config, hot), *neighbours], BatchPolicy())

    first = batch()
    assert first == batch() and len(first[0]) == 40


def test_seeded_autoregressive_sampling_ignores_its_neighbours(tiny_model):
    """A plain sampling stream draws once per token whatever the budgets: batched equals alone."""
    hot = SamplingParams(temperature=1.0, top_k=20, seed=11)
    alone = tokens_of(make_stream(tiny_model, PROMPTS[1], None, hot))
    neighbours = [make_stream(tiny_model, p, c) for p, c in zip(PROMPTS[2:], CONFIGS[2:], strict=True)]
    assert run_batch([make_stream(tiny_model, PROMPTS[1], None, hot), *neighbours], BatchPolicy())[0] == alone


def test_chunked_prefill_steps_carry_no_tokens_until_the_prompt_is_in(tiny_model):
    prompt = PROMPTS[4]
    neighbour = make_stream(tiny_model, PROMPTS[0], None)
    next(neighbour)  # prefilled: it decodes while the new prompt goes in by chunks
    stream = make_stream(tiny_model, prompt, CONFIGS[0])
    policy = BatchPolicy(max_step_tokens=16, prefill_chunk=4)
    chunks = []
    while True:
        step = step_batch([neighbour, stream], policy)[1]
        chunks.append(step)
        if step.token_ids:
            break
    assert [step.stats.input_tokens for step in chunks] == [4, 4, 4, 4, 3]
    assert all(step.stats.prefill for step in chunks) and not any(step.token_ids for step in chunks[:-1])
    assert stream.sequence.cache.length == len(prompt)


def test_one_forward_per_batch_step():
    model = cycle_model()
    streams = [make_stream(model, [1, 2, 3], LookaheadConfig(2, 3, 2)), make_stream(model, [4, 5], None)]
    before = model.forward_calls
    step_batch(streams, BatchPolicy())
    assert model.forward_calls == before + 1


def test_a_failing_stream_ends_alone(tiny_model):
    good = make_stream(tiny_model, PROMPTS[0], CONFIGS[0])
    bad = make_stream(tiny_model, PROMPTS[1], CONFIGS[0])
    bad.propose = lambda cost=None: (_ for _ in ()).throw(RuntimeError("broken stream"))
    results = step_batch([good, bad], BatchPolicy())
    assert isinstance(results[1], RuntimeError) and not isinstance(results[0], BaseException)
    assert results[0].token_ids  # the prefill committed the first token


def test_a_stream_the_guard_rests_takes_plain_steps_without_proposing_and_keeps_its_greedy_tokens(tiny_model):
    """Every verifying step fails the guard's price (100 plain steps each), so after each one the stream rests 3
    steps: budget 1, ``propose`` not called, a plain one-token step (``LookaheadStep.plan(1)`` after a step that
    ran the window); its window re-aligned (``jacobi.skip``), so its tokens stay greedy's."""
    alone = tokens_of(make_stream(tiny_model, PROMPTS[3], None))
    stream = make_stream(tiny_model, PROMPTS[3], LookaheadConfig(4, 4, 4))
    proposed = []
    propose = stream.propose
    stream.propose = lambda cost=None: proposed.append(1) or propose(cost)
    guard = PayoffGuard(lambda tokens: 100.0, trial=1, rest=3, max_rest=3, warmup=0)
    sizes, tokens = [], []
    while not stream.finished:
        (step,) = step_batch([stream], BatchPolicy(), guard=guard)
        tokens.extend(step.token_ids)
        sizes.append(step.stats.input_tokens)
    assert tokens == alone
    decoding = sizes[1:]  # after the prefill
    assert decoding[:8] == [decoding[0], 1, 1, 1, decoding[4], 1, 1, 1] and decoding[0] > 1 and decoding[4] > 1
    assert len(proposed) == sum(size > 1 for size in sizes)  # the prefill and each verifying step; a rested one not
    stream = make_stream(tiny_model, PROMPTS[3], LookaheadConfig(4, 4, 4))
    step_batch([stream], BatchPolicy())
    assert stream.propose().tokens > 1
    assert len(stream.plan(1).tokens) == 1  # the window's step shrinks to a plain one


def run_engine(engine: BatchEngine, requests: dict[str, tuple], join_at: dict[str, int]) -> dict[str, list[int]]:
    """Add each request (``(prompt, config)``) at its iteration and step until none runs; its tokens by id."""
    outputs: dict[str, list[int]] = {name: [] for name in requests}
    iteration = 0
    while iteration <= max(join_at.values()) or engine.has_work:
        for name, (prompt, config) in requests.items():
            if join_at[name] == iteration:
                engine.add(name, prompt, StopCriteria(40), SamplingParams(), config)
        for name, step in engine.step():
            assert not isinstance(step, BaseException), step
            outputs[name].extend(step.token_ids)
        iteration += 1
        assert iteration < 2000
    return outputs


def test_engine_requests_join_and_leave_with_their_greedy_tokens(tiny_model):
    requests = {f"r{i}": (prompt, config) for i, (prompt, config) in enumerate(zip(PROMPTS, CONFIGS, strict=True))}
    alone = {name: tokens_of(make_stream(tiny_model, prompt, config)) for name, (prompt, config) in requests.items()}
    engine = BatchEngine(tiny_model, BatchPolicy(max_step_tokens=16, prefill_chunk=4))
    assert run_engine(engine, requests, {"r0": 0, "r1": 0, "r2": 2, "r3": 5, "r4": 9, "r5": 4}) == alone
    assert len(engine) == 0 and not engine.has_work  # finished requests left by themselves


def test_engine_cancel_frees_the_request_and_leaves_the_others():
    model = cycle_model()
    closed: list[str] = []

    class Recorded(DecodeStream):
        def close(self) -> None:
            super().close()
            closed.append(self.sequence.tokens[0])

    engine = BatchEngine(model, open_stream=Recorded)
    engine.add("a", [1, 2], StopCriteria(20))
    engine.add("b", [4, 5], StopCriteria(20))
    assert [name for name, _ in engine.step()] == ["a", "b"]
    before = model.forward_calls
    engine.step()
    assert model.forward_calls == before + 1  # both requests in one forward
    engine.cancel("a")
    engine.cancel("a")  # idempotent
    assert closed == [1] and "a" not in engine and "b" in engine
    assert [name for name, _ in engine.step()] == ["b"]


def test_engine_a_failing_request_leaves_alone(tiny_model):
    engine = BatchEngine(tiny_model)
    engine.add("good", PROMPTS[0], StopCriteria(10), SamplingParams(), CONFIGS[0])
    engine.add("bad", PROMPTS[1], StopCriteria(10), SamplingParams(), CONFIGS[0])
    engine._streams["bad"].propose = lambda cost=None: (_ for _ in ()).throw(RuntimeError("broken stream"))
    results = dict(engine.step())
    assert isinstance(results["bad"], RuntimeError) and results["good"].token_ids
    assert "bad" not in engine and "good" in engine


def test_engine_validates_before_adding(tiny_model):
    engine = BatchEngine(tiny_model)
    with pytest.raises(InvalidParameterError) as error:
        engine.validate([1, 2], StopCriteria(-1))
    assert error.value.param == "max_tokens"
    with pytest.raises(InvalidParameterError):
        engine.add("x", [], StopCriteria(4))
    assert not engine.has_work
    engine.add("x", [1], StopCriteria(4))
    with pytest.raises(ValueError):
        engine.add("x", [1], StopCriteria(4))


def test_step_counts_keep_only_kept_tokens_and_sum():
    stats = StepStats(input_tokens=12, committed=3, offered=3, accepted=2, accepted_per_position=(True, True, False))
    assert stats.counts() == StepCounts(3, 1, 3, 2, (1, 1, 0))
    assert stats.counts(1) == StepCounts(1, 1, 3, 1, (1, 0, 0))
    assert stats.counts(0) == StepCounts(0, 0, 3, 0, (0, 0, 0))
    total = StepCounts() + stats.counts() + StepStats(1, 1).counts()
    assert total == StepCounts(4, 2, 3, 2, (1, 1, 0))
    assert total - stats.counts() == StepCounts(1, 1, 0, 0, (0, 0, 0))


def _permutation_model() -> StubLM:
    """next(t) = 5t + 3 mod 64: one cycle through all 64 tokens, so 40 tokens of output never repeat."""
    return StubLM(vocab_size=64, next_token=lambda token: (5 * token + 3) % 64)


@pytest.mark.parametrize(
    "config",
    [
        LookaheadConfig(1, 3, 2, lazy_window=True, copy_length=8, copy_min_match=1),
        LookaheadConfig(3, 4, 3, copy_length=0, copy_min_match=1),  # memory candidates join the pool's
    ],
    ids=["copies", "pool"],
)
def test_the_shared_memory_offers_an_earlier_requests_output_to_a_later_one(config):
    model = _permutation_model()
    first, second = [1, 2, 7, 20], [9, 33, 7, 20]  # the same last two tokens: the same continuation
    stop = StopCriteria(40)
    greedy_second = tokens_of(generate_autoregressive(model, second, stop))
    alone = list(generate_lookahead(model, second, stop, lookahead=config))
    engine = BatchEngine(model, memory=NGramMemory(1000))
    outputs = run_engine(engine, {"a": (first, config)}, {"a": 0})
    assert engine.memory.documents == 1 and len(engine.memory) == len(first) + len(outputs["a"])
    steps = []
    engine.add("b", second, stop, SamplingParams(), config)
    while engine.has_work:
        steps.extend(step for _, step in engine.step())
    assert tokens_of(steps) == greedy_second == tokens_of(alone)
    counts = sum((step.stats.counts() for step in steps), StepCounts())
    assert counts.memory_accepted > 20
    assert counts.memory_accepted <= counts.accepted
    assert len(steps) < len(alone) / 2


def test_a_remembered_output_accepted_whole_is_copied_further_with_copy_stretch():
    """The second request repeats the first's output: copies of the memory's best continuation, accepted whole,
    double in length (8, then 16) with ``copy_stretch`` 4, and the output is the same."""
    model = _permutation_model()
    config = LookaheadConfig(1, 3, 2, lazy_window=True, copy_length=8, copy_min_match=1)
    stop = StopCriteria(40)
    lengths = {}
    for stretch in (1, 4):
        engine = BatchEngine(model, memory=NGramMemory(1000))
        stretched = replace(config, copy_stretch=stretch)
        run_engine(engine, {"a": ([1, 2, 7, 20], stretched)}, {"a": 0})
        steps = []
        engine.add("b", [9, 33, 7, 20], stop, SamplingParams(), stretched)
        while engine.has_work:
            steps.extend(step for _, step in engine.step())
        assert tokens_of(steps) == tokens_of(generate_autoregressive(model, [9, 33, 7, 20], stop))
        lengths[stretch] = [step.stats.committed for step in steps]
    assert max(lengths[1]) == 9
    assert lengths[4][:3] == [1, 9, 17]
    assert len(lengths[4]) < len(lengths[1])


def test_a_request_opted_out_neither_feeds_nor_reads_the_shared_memory():
    model = _permutation_model()
    config = LookaheadConfig(1, 3, 2, lazy_window=True, copy_length=8, copy_min_match=1)
    engine = BatchEngine(model, memory=NGramMemory(1000))
    run_engine(engine, {"a": ([1, 2, 7, 20], replace(config, shared_memory=False))}, {"a": 0})
    assert len(engine.memory) == 0
    run_engine(engine, {"b": ([1, 2, 7, 20], config)}, {"b": 0})
    assert engine.memory.documents == 1
    steps = []
    engine.add("c", [9, 33, 7, 20], StopCriteria(40), SamplingParams(), replace(config, shared_memory=False))
    while engine.has_work:
        steps.extend(step for _, step in engine.step())
    assert sum(step.stats.memory_accepted for step in steps) == 0
    assert engine.memory.documents == 1


def test_greedy_output_is_unchanged_by_the_shared_memory(tiny_model):
    """Every request twice through one engine with a memory (the second round draws on the first's outputs):
    each output equals the stream's alone, for every config of the grid."""
    requests = {f"r{i}": (prompt, config) for i, (prompt, config) in enumerate(zip(PROMPTS, CONFIGS, strict=True))}
    alone = {name: tokens_of(make_stream(tiny_model, prompt, config)) for name, (prompt, config) in requests.items()}
    engine = BatchEngine(tiny_model, BatchPolicy(max_step_tokens=16, prefill_chunk=4), memory=NGramMemory(500))
    for _ in range(2):
        assert run_engine(engine, requests, {name: index for index, name in enumerate(requests)}) == alone
    assert engine.memory.documents > 0


def test_an_engine_step_is_a_launch_then_its_complete_and_nothing_touches_the_batch_in_between(tiny_model):
    """``step() == complete(launch())`` token for token (two engines, one stepped each way); while a step is in
    flight, adding, cancelling, launching or stepping again raises, and the flight's results are the step's."""
    engines = [BatchEngine(tiny_model, BatchPolicy()), BatchEngine(tiny_model, BatchPolicy())]
    for engine in engines:
        for index, (prompt, config) in enumerate(zip(PROMPTS[:3], CONFIGS[:3], strict=True)):
            engine.add(index, prompt, StopCriteria(12), lookahead=config)
    stepped, launched = ({index: [] for index in range(3)} for _ in range(2))
    while engines[0].has_work:
        for request_id, step in engines[0].step():
            stepped[request_id] += step.token_ids
        flight = engines[1].launch()
        for refused in (lambda: engines[1].add(9, [1, 2], StopCriteria(4)), lambda: engines[1].cancel(0),
                        engines[1].launch, engines[1].step):
            with pytest.raises(RuntimeError, match="in flight"):
                refused()
        for request_id, step in engines[1].complete(flight):
            launched[request_id] += step.token_ids
    assert not engines[1].has_work and launched == stepped and all(len(tokens) == 12 for tokens in stepped.values())
    with pytest.raises(RuntimeError, match="in flight"):
        engines[1].complete(flight)  # read once
