"""Lookahead decoding == greedy decoding, token for token; stops inside runs; KV fix-up; typed errors."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from decoding.errors import ContextLengthError, EmptyPromptError, InvalidParameterError
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.proposers.base import PROBE_INTERVAL, Gate, Span
from decoding.step.stream import generate_autoregressive, generate_lookahead
from tests.decoding.stubs import StubLM, cycle_model

PROMPTS = [
    [1, 5, 7, 9, 5, 7, 9, 5, 7, 3, 2, 5, 7],
    [10, 11, 12, 13, 10, 11, 12, 13, 10, 11],
    [42],
    [3, 3, 3, 3, 3, 3, 8, 3, 3],
]
GRID = list(itertools.product([1, 2, 4], [2, 3, 5], [0, 1, 3]))


def tokens_of(steps) -> list[int]:
    return [token for step in steps for token in step.token_ids]


def greedy(model, prompt, stop) -> list[int]:
    return tokens_of(generate_autoregressive(model, prompt, stop))


@pytest.mark.parametrize("window_size, ngram_size, guess_set_size", GRID)
def test_lookahead_equals_greedy_over_grid(tiny_model, window_size, ngram_size, guess_set_size):
    config = LookaheadConfig(window_size, ngram_size, guess_set_size)
    stop = StopCriteria(max_tokens=40)
    for prompt in PROMPTS:
        assert tokens_of(generate_lookahead(tiny_model, prompt, stop, lookahead=config)) == greedy(
            tiny_model, prompt, stop
        )


@pytest.mark.parametrize("window_size, ngram_size, guess_set_size", GRID)
def test_lookahead_with_window_chains_equals_greedy_over_grid(tiny_model, window_size, ngram_size, guess_set_size):
    config = LookaheadConfig(window_size, ngram_size, guess_set_size, window_chains=True, copy_length=16,
                             copy_min_match=0, copy_candidates=3)
    stop = StopCriteria(max_tokens=40)
    for prompt in PROMPTS:
        assert tokens_of(generate_lookahead(tiny_model, prompt, stop, lookahead=config)) == greedy(
            tiny_model, prompt, stop
        )


@pytest.mark.parametrize(
    "config",
    [
        LookaheadConfig(3, 4, 3, prompt_pool=False, output_pool=False),
        LookaheadConfig(3, 4, 3, align_window=False),
        LookaheadConfig(7, 5, 7),
        LookaheadConfig(1, 2, 0),
        LookaheadConfig(2, 4, 2, lazy_window=True),
        LookaheadConfig(3, 3, 3, lazy_window=True, align_window=False),
        LookaheadConfig(2, 4, 3, lazy_window=True, break_even=1.5),
        LookaheadConfig(3, 4, 3, break_even=2.5),
        LookaheadConfig(2, 4, 3, lazy_window=True, break_even=0.5, copy_length=10),
        LookaheadConfig(1, 3, 2, copy_length=32),
        LookaheadConfig(1, 3, 2, lazy_window=True, break_even=0.85, copy_length=16, copy_min_match=1),
        LookaheadConfig(5, 4, 5, copy_length=16, copy_min_match=2),
        LookaheadConfig(1, 3, 2, lazy_window=True, break_even=0.85, copy_length=16, copy_min_match=1,
                        copy_candidates=4),
        LookaheadConfig(5, 4, 5, copy_length=32, copy_min_match=1, copy_candidates=3),
        LookaheadConfig(15, 5, 15, copy_length=48, copy_min_match=1, copy_candidates=4),
        LookaheadConfig(5, 4, 5, copy_length=32, copy_min_match=0, copy_candidates=8),
        LookaheadConfig(5, 4, 5, copy_length=4, copy_min_match=0, copy_candidates=3, copy_stretch=8),
        LookaheadConfig(1, 3, 2, lazy_window=True, break_even=0.85, copy_length=2, copy_min_match=1, copy_stretch=4),
    ],
    ids=["no-context-pool", "unaligned", "7-5-7", "degenerate", "lazy", "lazy-unaligned", "gated-lazy", "gated",
         "copy", "copy-long", "copy-2gram", "copy-3gram", "copies-lazy", "tree-window-copies", "tree-wide",
         "copies-1gram", "copies-stretched", "copy-stretched-lazy"],
)
def test_lookahead_equals_greedy_for_variants(tiny_model, config):
    stop = StopCriteria(max_tokens=60)
    for prompt in PROMPTS:
        assert tokens_of(generate_lookahead(tiny_model, prompt, stop, lookahead=config)) == greedy(
            tiny_model, prompt, stop
        )


def test_tiny_model_lookahead_does_accept_guesses(tiny_model):
    """The grid above is only meaningful if multi-token steps happen: check they do."""
    steps = list(generate_lookahead(tiny_model, PROMPTS[0], StopCriteria(60), lookahead=LookaheadConfig(4, 4, 4)))
    assert sum(step.stats.accepted for step in steps) > 0
    assert len(steps) < 60


def test_all_guesses_accepted_when_the_prompt_holds_the_continuation():
    model = cycle_model(period=8)
    prompt = list(range(8)) * 2  # the pool knows every continuation
    config = LookaheadConfig(window_size=2, ngram_size=4, guess_set_size=2)
    steps = list(generate_lookahead(model, prompt, StopCriteria(max_tokens=25), lookahead=config))
    assert tokens_of(steps) == [(token + 1) % 8 for token in range(15, 40)]
    decode_steps = steps[1:]
    assert all(step.stats.accepted == step.stats.offered == 3 for step in decode_steps[:-1])
    assert all(step.stats.committed == 4 for step in decode_steps[:-1])  # N tokens: 3 guessed + 1 read off
    assert [step.stats.committed for step in steps] == [1, 4, 4, 4, 4, 4, 4, 0 + 4][: len(steps)]
    assert all(step.stats.accepted_per_position == (True, True, True) for step in decode_steps)


def test_a_copy_step_commits_more_than_n_tokens_when_the_context_repeats():
    model = cycle_model(period=8)
    prompt = list(range(8)) * 2  # after the prefill, the last 7 tokens match an earlier context
    config = LookaheadConfig(window_size=1, ngram_size=3, guess_set_size=2, copy_length=10)
    steps = list(generate_lookahead(model, prompt, StopCriteria(max_tokens=30), lookahead=config))
    assert tokens_of(steps) == [(token + 1) % 8 for token in range(15, 45)]
    copy = steps[1].stats
    assert (copy.input_tokens, copy.offered, copy.accepted, copy.committed) == (1 + 8, 8, 8, 9)
    assert max(step.stats.committed for step in steps) > config.ngram_size
    without = replace(config, copy_length=0)
    assert len(steps) < len(list(generate_lookahead(model, prompt, StopCriteria(max_tokens=30), lookahead=without)))


def test_copies_accepted_whole_stretch_the_next_copy_up_to_copy_stretch_times_copy_length():
    model = cycle_model(period=8)
    prompt = list(range(8)) * 2
    config = LookaheadConfig(window_size=1, ngram_size=3, guess_set_size=2, copy_length=4, copy_stretch=4)
    stop = StopCriteria(max_tokens=60)
    stretched = list(generate_lookahead(model, prompt, stop, lookahead=config))
    plain = list(generate_lookahead(model, prompt, stop, lookahead=replace(config, copy_stretch=1)))
    assert tokens_of(stretched) == tokens_of(plain) == greedy(model, prompt, stop)
    # copies of 4, 8, then 16 tokens (4 x 4), each accepted whole and followed by the model's own token
    assert [step.stats.committed for step in stretched] == [1, 5, 9, 17, 17, 11]
    assert {step.stats.committed for step in plain[1:-1]} == {5}


def test_a_copy_span_doubles_on_whole_copies_and_starts_over_after_a_partial_one():
    span = Span(base=4, limit=16)
    lengths = []
    for copied in (4, 8, 16, 16, 15, 3, 4):
        span.update(copied)
        lengths.append(span.length)
    assert lengths == [8, 16, 16, 16, 4, 4, 8]
    off = Span(base=4, limit=4)  # copy_stretch 1
    off.update(4)
    assert off.length == 4


def test_several_copy_candidates_verify_the_runner_up_in_the_same_step():
    """Two earlier occurrences of "1 2" continue differently and the model follows the older one: one copy
    candidate tries only the most recent continuation and fails, two also verify the older one."""
    follow = {1: 2, 2: 3, 3: 4, 4: 5, 5: 6, 6: 7}
    model = StubLM(vocab_size=64, next_token=lambda token: follow.get(token, 1))
    prompt = [9, 1, 2, 3, 4, 5, 6, 8, 1, 2, 30, 31, 32, 33, 7, 1]  # then 2; copies of 2: (30..33, 7), (3..6, 8)
    config = LookaheadConfig(1, 2, 0, copy_length=5, copy_min_match=1, output_pool=False)
    stop = StopCriteria(6)
    one = list(generate_lookahead(model, prompt, stop, lookahead=config))
    two = list(generate_lookahead(model, prompt, stop, lookahead=replace(config, copy_candidates=2)))
    assert tokens_of(one) == tokens_of(two) == greedy(model, prompt, stop) == [2, 3, 4, 5, 6, 7]
    assert one[1].stats.accepted == 0
    assert (two[1].stats.accepted, two[1].stats.committed) == (4, 5)  # 3 4 5 6 accepted, then the model's 7
    assert len(two) < len(one)


def test_candidates_sharing_a_prefix_share_input_tokens():
    """Copies that agree on their first tokens are verified as one token tree: fewer inputs than their sum."""
    model = cycle_model(period=8)
    prompt = [0, 1, 2, 3, 4, 5, 9, 9, 0, 1, 2, 3, 4, 5, 6, 1, 0, 1, 2, 3, 4, 8, 0, 0, 0, 1, 2]
    config = LookaheadConfig(1, 2, 0, copy_length=4, copy_min_match=1, copy_candidates=3, output_pool=False)
    stop = StopCriteria(8)
    steps = list(generate_lookahead(model, prompt, stop, lookahead=config))
    assert tokens_of(steps) == greedy(model, prompt, stop)
    first = steps[1].stats  # copies of 3: (4, 8, 0, 0), (4, 5, 6, 1), (4, 5, 9, 9): 9 tree nodes, not 12
    assert first.input_tokens == 1 + 9
    assert (first.accepted, first.committed) == (3, 4)  # 4 5 6 accepted, then the model's 7


def test_no_guess_accepted_when_every_candidate_is_wrong():
    model = StubLM(vocab_size=64, next_token=lambda token: (token + 1) % 64)
    prompt = list(range(0, 64, 2))  # pool: 2k -> (2k+2,) while the model continues 2k -> 2k+1
    config = LookaheadConfig(window_size=1, ngram_size=2, guess_set_size=3, output_pool=False)
    steps = list(generate_lookahead(model, prompt, StopCriteria(max_tokens=12), lookahead=config))
    assert tokens_of(steps) == [63, *range(0, 11)]
    offered = [step.stats.offered for step in steps[1:]]
    assert sum(offered) > 0
    assert sum(step.stats.accepted for step in steps) == 0
    assert all(step.stats.committed == 1 for step in steps)


def test_jacobi_window_alone_produces_accepted_ngrams():
    """With no context pool, the counting stub's window converges and its n-grams get accepted."""
    model = StubLM(vocab_size=64, next_token=lambda token: (token + 1) % 64)
    config = LookaheadConfig(window_size=4, ngram_size=3, guess_set_size=4, prompt_pool=False, output_pool=False)
    prompt = [5, 9, 2, 40, 33, 17]
    steps = list(generate_lookahead(model, prompt, StopCriteria(max_tokens=30), lookahead=config))
    assert tokens_of(steps) == [(17 + k) % 64 for k in range(1, 31)]
    assert sum(step.stats.accepted for step in steps) > 0
    assert len(steps) < 30


def test_some_guesses_accepted_when_a_candidate_diverges_midway():
    model = cycle_model(period=8)
    prompt = [3, 4, 5, 9, 0]  # pool: 3 -> (4, 5, 9); the model continues 3 -> 4 -> 5 -> 6
    config = LookaheadConfig(window_size=1, ngram_size=4, guess_set_size=1, output_pool=False)
    steps = list(generate_lookahead(model, prompt, StopCriteria(max_tokens=6), lookahead=config))
    assert tokens_of(steps) == [1, 2, 3, 4, 5, 6]
    last = steps[-1].stats
    assert (last.offered, last.accepted, last.committed) == (3, 2, 3)
    assert last.accepted_per_position == (True, True, False)
    assert [step.stats.offered for step in steps[:-1]] == [0, 0, 0]


def test_lazy_window_runs_one_token_steps_without_candidates():
    model = StubLM(vocab_size=64, next_token=lambda token: (token + 1) % 64)
    prompt = [3, 4, 5, 6, 9, 20]  # the pool knows 3 -> (4, 5), 4 -> (5, 6) only
    config = LookaheadConfig(window_size=4, ngram_size=3, guess_set_size=2, lazy_window=True, output_pool=False)
    steps = list(generate_lookahead(model, prompt, StopCriteria(max_tokens=8), lookahead=config))
    assert tokens_of(steps) == list(range(21, 29))
    assert [step.stats.input_tokens for step in steps[1:]] == [1] * 7
    with_candidates = list(generate_lookahead(model, [3, 4, 5, 6, 2], StopCriteria(max_tokens=3), lookahead=config))
    assert [step.stats.input_tokens for step in with_candidates[1:]] == [4 + 2]  # row 0 plus one candidate


def test_low_acceptance_falls_back_to_plain_steps_with_periodic_probes():
    model = StubLM(vocab_size=64, next_token=lambda token: (token + 1) % 64)
    prompt = [*range(0, 64, 2), 1]  # every even key proposes a wrong continuation; the model counts 2, 3, 4...
    config = LookaheadConfig(1, 3, 2, output_pool=False, lazy_window=True, break_even=0.5)
    steps = list(generate_lookahead(model, prompt, StopCriteria(max_tokens=40), lookahead=config))
    assert tokens_of(steps) == list(range(2, 42))
    verifying = [index for index, step in enumerate(steps) if step.stats.offered]
    assert 3 <= len(verifying) <= 8, verifying  # a few verifying steps, then only probes
    assert sum(step.stats.input_tokens == 1 for step in steps[1:]) >= 30
    ungated = list(
        generate_lookahead(
            model,
            prompt,
            StopCriteria(max_tokens=40),
            lookahead=config.__class__(1, 3, 2, output_pool=False, lazy_window=True),
        )
    )
    assert sum(bool(step.stats.offered) for step in ungated) >= 15


def test_probes_back_off_while_guessing_does_not_pay_and_start_over_once_it_does():
    gate = Gate(start=0.0)
    probes = [call for call in range(1, 201) if gate.pays(break_even=0.5)]
    assert probes == [8, 24, 56, 120, 184]  # waits of 8, 16, 32, 64, 64
    gate.update(accepted=4)  # a probe that paid: the mean is back above break-even
    assert gate.pays(break_even=0.5) and gate.interval == PROBE_INTERVAL
    gate.update(accepted=0)
    gate.update(accepted=0)
    gate.update(accepted=0)
    assert [call for call in range(1, 9) if gate.pays(break_even=0.5)] == [8]


def test_eos_inside_an_accepted_run_stops_there():
    model = cycle_model(period=8)
    prompt = list(range(8)) * 2
    config = LookaheadConfig(window_size=2, ngram_size=5, guess_set_size=2)
    # prefill commits 0, the first step would commit 1 2 3 4 5: token 3 ends it
    steps = list(generate_lookahead(model, prompt, StopCriteria(50, frozenset({3})), lookahead=config))
    assert tokens_of(steps) == [0, 1, 2]
    assert steps[-1].finish_reason == "stop"
    assert steps[-1].stats.committed == 2 and steps[-1].stats.accepted == 2


def test_max_tokens_inside_an_accepted_run_stops_there():
    model = cycle_model(period=8)
    prompt = list(range(8)) * 2
    config = LookaheadConfig(window_size=2, ngram_size=5, guess_set_size=2)
    steps = list(generate_lookahead(model, prompt, StopCriteria(max_tokens=7), lookahead=config))
    assert tokens_of(steps) == [0, 1, 2, 3, 4, 5, 6]
    assert [step.stats.committed for step in steps] == [1, 5, 1]
    assert steps[-1].finish_reason == "length"
    assert all(step.finish_reason is None for step in steps[:-1])


@pytest.mark.parametrize("generate", [generate_autoregressive, generate_lookahead])
def test_only_the_last_step_carries_a_finish_reason(tiny_model, generate):
    reference = greedy(tiny_model, PROMPTS[0], StopCriteria(30))
    for stop, reason in [(StopCriteria(12), "length"), (StopCriteria(30, frozenset({reference[9]})), "stop")]:
        steps = list(generate(tiny_model, PROMPTS[0], stop))
        assert [step.finish_reason for step in steps] == [None] * (len(steps) - 1) + [reason]


def test_stop_on_the_prefill_token_emits_nothing(tiny_model):
    first = greedy(tiny_model, PROMPTS[0], StopCriteria(1))[0]
    for generate in (generate_autoregressive, generate_lookahead):
        steps = list(generate(tiny_model, PROMPTS[0], StopCriteria(10, frozenset({first}))))
        assert tokens_of(steps) == [] and steps[-1].finish_reason == "stop"


def test_stop_token_matches_greedy_truncation(tiny_model):
    stop = StopCriteria(60)
    reference = greedy(tiny_model, PROMPTS[1], stop)
    stop_token = reference[len(reference) // 2]
    expected = reference[: reference.index(stop_token)]
    config = LookaheadConfig(4, 4, 4)
    stopped = StopCriteria(60, frozenset({stop_token}))
    assert tokens_of(generate_lookahead(tiny_model, PROMPTS[1], stopped, lookahead=config)) == expected


def _reference_cache(model, tokens: list[int]) -> DynamicCache:
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("stop_token", [None, "mid-run"])
def test_kv_fixup_matches_a_fresh_full_sequence_forward(tiny_model, stop_token):
    """After every step, the cache equals the KV of a plain forward over every committed token but ``last``."""
    prompt = PROMPTS[0]
    stop = StopCriteria(40)
    if stop_token == "mid-run":
        stop = StopCriteria(40, frozenset({greedy(tiny_model, prompt, stop)[20]}))
    config = LookaheadConfig(4, 4, 4)
    stream = generate_lookahead(tiny_model, prompt, stop, lookahead=config)
    sequence = stream.sequence
    multi_token_steps = 0
    with torch.inference_mode():
        for step in stream:
            multi_token_steps += step.stats.committed > 1
            reference = _reference_cache(tiny_model, sequence.tokens[:-1])
            assert sequence.cache.length == len(sequence.tokens) - 1
            for layer, (keys, values, _) in zip(sequence.cache.layers, reference, strict=True):
                torch.testing.assert_close(layer.keys, keys, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(layer.values, values, rtol=1e-4, atol=1e-5)
    assert multi_token_steps > 0


@pytest.mark.parametrize(
    "config, param",
    [
        (LookaheadConfig(window_size=0), "window_size"),
        (LookaheadConfig(copy_length=65), "copy_length"),
        (LookaheadConfig(copy_candidates=0), "copy_candidates"),
        (LookaheadConfig(copy_candidates=9), "copy_candidates"),
        (LookaheadConfig(copy_stretch=0), "copy_stretch"),
        (LookaheadConfig(copy_stretch=9), "copy_stretch"),
        (LookaheadConfig(copy_length=-1), "copy_length"),
        (LookaheadConfig(copy_min_match=-1), "copy_min_match"),
        (LookaheadConfig(copy_min_match=9), "copy_min_match"),
        (LookaheadConfig(ngram_size=1), "ngram_size"),
        (LookaheadConfig(guess_set_size=-1), "guess_set_size"),
        (LookaheadConfig(window_size=1000), "window_size"),
        (LookaheadConfig(window_size=64, ngram_size=16, guess_set_size=64), "lookahead"),
        (LookaheadConfig(break_even=-1.0), "break_even"),
    ],
)
def test_bad_lookahead_arguments_raise_typed_errors(tiny_model, config, param):
    with pytest.raises(InvalidParameterError) as error:
        next(generate_lookahead(tiny_model, [1, 2], StopCriteria(4), lookahead=config))
    assert error.value.param == param


@pytest.mark.parametrize(
    "sampling, stop, param",
    [
        (SamplingParams(temperature=-0.1), StopCriteria(4), "temperature"),
        (SamplingParams(temperature=1.0, top_p=-0.5), StopCriteria(4), "top_p"),
        (SamplingParams(temperature=1.0, top_k=-2), StopCriteria(4), "top_k"),
        (SamplingParams(temperature=float("nan")), StopCriteria(4), "temperature"),
        (SamplingParams(), StopCriteria(-1), "max_tokens"),
    ],
)
def test_bad_sampling_and_stop_arguments_raise_typed_errors(tiny_model, sampling, stop, param):
    for generate in (generate_autoregressive, generate_lookahead):
        with pytest.raises(InvalidParameterError) as error:
            next(generate(tiny_model, [1, 2], stop, sampling))
        assert error.value.param == param


def test_empty_prompt_and_context_overflow(tiny_model):
    with pytest.raises(EmptyPromptError):
        next(generate_lookahead(tiny_model, [], StopCriteria(4)))
    with pytest.raises(ContextLengthError) as error:
        next(generate_autoregressive(tiny_model, [1] * 500, StopCriteria(13)))
    assert error.value.context_length == 512 and error.value.param == "max_tokens"
    with pytest.raises(ContextLengthError) as error:
        next(generate_lookahead(tiny_model, [1] * 600, StopCriteria(1)))
    assert error.value.param == "prompt"


def test_a_timed_step_is_the_step_with_its_seconds_set():
    """``Step.timed`` (the stream's per-step timing, without ``dataclasses.replace``) keeps every other field."""
    from dataclasses import fields

    from decoding.step.steps import Step, StepStats
    stats = StepStats(*(f"stats {index}" for index, _ in enumerate(fields(StepStats))))
    step = Step("tokens", stats, *(f"step {index}" for index, _ in enumerate(fields(Step)[2:])))
    assert step.timed(1.5) == replace(step, stats=replace(stats, seconds=1.5))
    assert step.timed(1.5, 7) == replace(step, stats=replace(stats, seconds=1.5), cached_tokens=7)
