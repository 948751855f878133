"""The benchmark's measurement: method order, runners, and small timed runs on a tiny random LLaMA."""

from __future__ import annotations

import dataclasses

import pytest

from bench import measure, records, report
from decoding.batch import BatchPolicy
from decoding.errors import InvalidParameterError
from decoding.params import LookaheadConfig, StopCriteria
from decoding.payoff import PayoffGuard
from decoding.proposers.ngram_memory import NGramMemory
from decoding.weights.linears import pack_float32
from tests.conftest import tiny_llama

EOS = 2
ALL_METHODS = "greedy,lookahead,generate,prompt_lookup"


def test_rotation_gives_each_method_each_slot() -> None:
    methods = ["a", "b", "c"]
    orders = [measure.rotation(methods, index) for index in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert measure.rotation(methods, 4) == ["b", "c", "a"]


def test_parse_methods_rejects_unknown_and_repeated_names() -> None:
    assert measure.parse_methods(" greedy, prompt_lookup ") == ["greedy", "prompt_lookup"]
    for bad in ("greedy,beam", "", "greedy,greedy"):
        with pytest.raises(ValueError):
            measure.parse_methods(bad)


# --- on a tiny model ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


def test_run_benchmark_interleaves_methods_and_matches_greedy(model) -> None:
    prompts = [("a", [5, 9, 11, 5, 9, 11, 5, 9]), ("b", [3, 4, 5, 6, 7]), ("c", [40, 41])]
    runners = measure.make_runners(measure.parse_methods(ALL_METHODS), LookaheadConfig(2, 3, 2), prompt_lookup_tokens=3)
    runs = measure.run_benchmark(model, prompts, runners, max_tokens=20, stop_token_ids=frozenset({EOS}), warmup=1)
    assert [run.method for run in runs[4:8]] == ["lookahead", "generate", "prompt_lookup", "greedy"]
    assert [run.id for run in runs] == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    grouped = report.by_method(runs)
    for prompt_id, _ in prompts:
        greedy = grouped["greedy"][prompt_id]
        assert 1 <= greedy.new_tokens <= 20 and EOS not in greedy.output_ids
        assert greedy.steps == greedy.new_tokens + (greedy.new_tokens < 20)  # one forward per token (+ EOS)
        for method in ("lookahead", "generate", "prompt_lookup"):
            assert grouped[method][prompt_id].output_ids == greedy.output_ids, (method, prompt_id)
        assert grouped["generate"][prompt_id].steps == greedy.steps
        assert grouped["lookahead"][prompt_id].steps <= greedy.steps
    assert all(run.seconds > 0 for run in runs)
    repetitive = grouped["lookahead"]["a"]  # the pool guesses right on this model: fewer forwards than tokens
    assert repetitive.steps < repetitive.new_tokens and repetitive.offered > 0 and repetitive.accepted > 0


def test_rounds_keep_each_methods_median_run_per_prompt(model, monkeypatch) -> None:
    """Three rounds per prompt, the methods' order rotating each round; one record per prompt and method, the one of
    median time (the clock's seconds are each run's index here, so the median is the middle round's)."""
    runs_made: list[tuple[str, str]] = []
    real = measure.time_run

    def counted(model, prompt_id, method, runner, prompt_ids, stop):
        record = real(model, prompt_id, method, runner, prompt_ids, stop)
        runs_made.append((prompt_id, method))
        return dataclasses.replace(record, seconds=float(len(runs_made)))

    monkeypatch.setattr(measure, "time_run", counted)
    runners = measure.make_runners(["greedy", "lookahead"], LookaheadConfig(2, 3, 2), prompt_lookup_tokens=3)
    progress: list[str] = []
    runs = measure.run_benchmark(model, [("a", [5, 9, 11, 5]), ("b", [3, 4, 5])], runners, max_tokens=6,
                                 warmup=0, progress=lambda run: progress.append(run.method), rounds=3)
    assert runs_made == [("a", "greedy"), ("a", "lookahead"), ("a", "lookahead"), ("a", "greedy"), ("a", "greedy"),
                         ("a", "lookahead"), ("b", "lookahead"), ("b", "greedy"), ("b", "greedy"),
                         ("b", "lookahead"), ("b", "lookahead"), ("b", "greedy")]
    assert len(progress) == 12 and [(run.id, run.method, run.seconds) for run in runs] == [
        ("a", "greedy", 4.0), ("a", "lookahead", 3.0), ("b", "lookahead", 10.0), ("b", "greedy", 9.0)]


def test_lookahead_shares_a_memory_that_forgets_the_warm_up(model) -> None:
    # As a server's requests do: each decode adds its output, later ones may draw on it; the warm-up's decodes of
    # the first prompt must not reach its measured run.
    memory = NGramMemory(10_000)
    runners = measure.make_runners(["greedy", "lookahead"], LookaheadConfig(2, 3, 2, copy_length=8), 3,
                                   memory=memory)
    calls = []

    def forget() -> None:
        calls.append((memory.documents, len(memory)))
        memory.clear()

    prompts = [("a", [5, 9, 11, 5, 9, 11, 5, 9]), ("b", [5, 9, 11, 5, 9, 11, 5, 9])]
    runs = measure.run_benchmark(model, prompts, runners, max_tokens=16, stop_token_ids=frozenset({EOS}), warmup=2,
                                 after_warmup=forget)
    assert calls == [(2, calls[0][1])] and calls[0][1] > 0  # called once, after both warm-up decodes
    assert memory.documents == 2  # one document per measured lookahead decode
    grouped = report.by_method(runs)
    for prompt_id in ("a", "b"):
        assert grouped["lookahead"][prompt_id].output_ids == grouped["greedy"][prompt_id].output_ids
    assert grouped["lookahead"]["b"].steps <= grouped["lookahead"]["a"].steps  # b may copy a's output


def test_transformers_methods_run_on_their_own_model_when_given_one(model) -> None:
    packed = pack_float32(tiny_llama(seed=3))  # ours: the same weights, packed linears
    methods = ["greedy", "generate", "prompt_lookup"]
    runners = measure.make_runners(methods, LookaheadConfig(), 3, transformers_model=model)
    calls = {"ours": 0, "transformers": 0}
    hooks = [  # one output projection per forward, whichever way the forward runs (decoding.forward.lean or not)
        packed.lm_head.register_forward_pre_hook(lambda *_: calls.__setitem__("ours", calls["ours"] + 1)),
        model.lm_head.register_forward_pre_hook(
            lambda *_: calls.__setitem__("transformers", calls["transformers"] + 1)
        ),
    ]
    try:
        stop = StopCriteria(6)
        greedy = runners["greedy"](packed, [5, 9, 11, 5, 9], stop)
        assert calls == {"ours": greedy.steps, "transformers": 0}
        generated = runners["generate"](packed, [5, 9, 11, 5, 9], stop)
        runners["prompt_lookup"](packed, [5, 9, 11, 5, 9], stop)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls["ours"] == greedy.steps and calls["transformers"] >= generated.steps > 0
    assert generated.output_ids == greedy.output_ids


def test_generate_strips_a_trailing_stop_token(model) -> None:
    greedy = measure.decode_greedy(model, [7, 8, 9], StopCriteria(12))
    stop_token = greedy.output_ids[4]
    first_stop = greedy.output_ids.index(stop_token)
    stopped = measure.decode_generate(model, [7, 8, 9], StopCriteria(12, frozenset({stop_token})))
    assert stopped.output_ids == greedy.output_ids[:first_stop]
    assert stopped.steps == first_stop + 1


def test_step_cost_curve_on_a_tiny_model(model) -> None:
    results = measure.measure_step_cost(model, context=20, ks=(1, 2, 8), repeats=1)
    assert [r.k for r in results] == [1, 2, 8]
    assert all(r.ms_last_logits > 0 and r.ms_all_logits > 0 for r in results)
    rows = report.step_cost_rows(results)
    assert rows[0][2] == "1.00x" and rows[0][4] == "1.00x"
    with pytest.raises(InvalidParameterError, match="context"):
        measure.measure_step_cost(model, context=500, ks=(1, 128))


def test_lookahead_under_a_batch_policy_steps_as_the_generator_does(model) -> None:
    """The server's path (``step_batch`` with a ``BatchPolicy``) and the generator commit the same steps."""
    config, stop = LookaheadConfig(2, 3, 2, copy_length=4), StopCriteria(20, frozenset({EOS}))
    plain = measure.decode_lookahead(model, [5, 9, 11, 5, 9, 11, 5, 9], stop, config)
    batched = measure.decode_lookahead(model, [5, 9, 11, 5, 9, 11, 5, 9], stop, config, BatchPolicy())
    assert batched == plain and batched.steps < len(batched.output_ids)
    runners = measure.make_runners(["lookahead"], config, 3, policy=BatchPolicy(max_step_tokens=4))
    assert runners["lookahead"](model, [5, 9, 11, 5, 9, 11, 5, 9], stop) == plain  # a lone stream is never capped


def test_lookaheads_decodes_share_one_payoff_guard_priced_on_the_wall_given(model) -> None:
    """As the server's engine keeps one guard for all its requests: each decode is forgotten when it ends; the guard
    gets the policy with ``measure_step_cost`` only when a wall prices it (a CPU's seconds say nothing of a GPU)."""
    config, stop, prompt = LookaheadConfig(4, 4, 4), StopCriteria(30, frozenset()), [5, 9, 11, 5, 9, 11, 5, 9]
    greedy = measure.decode_greedy(model, prompt, stop)
    built: list[tuple[BatchPolicy, PayoffGuard]] = []

    def never_pays(policy: BatchPolicy) -> PayoffGuard:
        built.append((policy, PayoffGuard(lambda tokens: 100.0, trial=1, rest=3, max_rest=3, warmup=0)))
        return built[-1][1]

    measured = BatchPolicy(measure_step_cost=True)
    runners = measure.make_runners(["lookahead"], config, 3, policy=measured, guard=never_pays)
    first, second = (runners["lookahead"](model, prompt, stop) for _ in range(2))
    assert first == second and first.output_ids == greedy.output_ids
    decoding = first.step_tokens[first.prefill_steps:]
    assert decoding[1:4] == [1, 1, 1] and decoding[0] > 1  # a verifying step, then three rested
    (policy, guard), = built  # one guard for both decodes, each forgotten at its end
    assert not policy.measure_step_cost and guard._watches == {}
    seconds: list[float] = []
    measure.make_runners(["lookahead"], config, 3, policy=measured, guard=never_pays,
                         wall=lambda stats, spent: seconds.append(spent) or 0.004)["lookahead"](model, prompt, stop)
    assert built[-1][0].measure_step_cost and len(seconds) == len(first.step_tokens)


def test_a_runner_that_timed_its_decode_gives_the_seconds_and_base_methods_need_their_child(model) -> None:
    def timed(_model, prompt_ids, stop) -> records.Decoded:
        return records.Decoded([7], 1, seconds=0.25)

    record = measure.time_run(model, "a", "base_greedy", timed, [1, 2], StopCriteria(1))
    assert (record.seconds, record.output_ids, record.steps) == (0.25, [7], 1)
    with pytest.raises(ValueError, match="--baseline"):
        measure.make_runners(["greedy", "base_lookahead"], LookaheadConfig(2, 3, 2), prompt_lookup_tokens=3)
