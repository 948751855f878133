"""Penalties, logit bias, min_p, min_tokens: the adjustment function on tiny tensors, lookahead == greedy with
each setting over a W/N/G grid with copy steps, and a penalised sampling distribution."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from decoding.errors import InvalidParameterError
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.step.logits import adjust_logits
from decoding.step.sampling import warp
from decoding.step.stream import generate_autoregressive, generate_lookahead
from tests.decoding.step.test_sampling import P_FLOOR, goodness_of_fit, tiny_vocab_model
from tests.decoding.step.test_stream import PROMPTS, tokens_of


def test_frequency_and_presence_count_the_output_and_each_rows_path():
    logits = torch.zeros(3, 8)
    sampling = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)
    scores = adjust_logits(logits, sampling, StopCriteria(10), [5, 6], 1, [(), (6, 6), (7,)])
    assert scores[0].tolist() == [0, 0, 0, 0, 0, 0, -1.5, 0]  # the prompt's 5 does not count
    assert scores[1, 6] == -3.5
    assert scores[2, 6] == -1.5 and scores[2, 7] == -1.5


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]] * 2)
    scores = adjust_logits(logits, SamplingParams(repetition_penalty=2.0), StopCriteria(10), [0, 1], 2, [(), (2,)])
    assert scores[0].tolist() == [1.0, -4.0, 2.0, -2.0]
    assert scores[1].tolist() == [1.0, -4.0, 1.0, -2.0]


def test_logit_bias_and_min_tokens_per_row():
    logits = torch.zeros(3, 4)
    sampling = SamplingParams(logit_bias=((1, 5.0), (99, 1.0)))
    stop = StopCriteria(10, frozenset({3}), min_tokens=2)
    scores = adjust_logits(logits, sampling, stop, [0, 2], 1, [(), (2,), (2, 2)])  # 1 generated so far
    assert scores[:, 1].tolist() == [5.0, 5.0, 5.0]
    assert scores[:, 3].tolist() == [float("-inf"), 0.0, 0.0]


def test_min_p_keeps_tokens_at_least_min_p_times_the_best():
    probs = warp(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), SamplingParams(temperature=1.0, min_p=0.4))
    assert probs[0, 2:].tolist() == [0.0, 0.0] and abs(float(probs[0, 0]) - 0.625) < 1e-6


def test_top_p_zero_keeps_only_the_top_token():
    probs = warp(torch.tensor([[0.1, 2.0, 1.9]]), SamplingParams(temperature=1.0, top_p=0.0))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "field, value",
    [("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
     ("logit_bias", ((1, 101.0),)), ("logit_bias", ((-1, 1.0),)), ("top_p", -0.1)],
)
def test_out_of_range_settings_name_their_field(field, value):
    with pytest.raises(InvalidParameterError) as raised:
        SamplingParams(**{field: value}).validate()
    assert raised.value.param == field


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(InvalidParameterError) as raised:
        StopCriteria(4, min_tokens=5).validate()
    assert raised.value.param == "min_tokens"


SETTINGS = {
    "presence": (SamplingParams(presence_penalty=1.5), None),
    "frequency": (SamplingParams(frequency_penalty=0.7), None),
    "repetition": (SamplingParams(repetition_penalty=1.3), None),
    "negative-frequency": (SamplingParams(frequency_penalty=-1.0), None),
    "logit-bias": (SamplingParams(logit_bias=((3, 2.0), (9, -100.0), (12, 4.0))), None),
    "min-tokens": (SamplingParams(), 30),
    "combined": (SamplingParams(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.1,
                                logit_bias=((5, 1.0),), min_p=0.1), 12),
}
CONFIGS = [
    LookaheadConfig(2, 3, 2),
    LookaheadConfig(4, 4, 4),
    LookaheadConfig(5, 4, 5, copy_length=16, copy_min_match=1, copy_candidates=3),
    LookaheadConfig(1, 3, 2, lazy_window=True, copy_length=16, copy_min_match=1, copy_candidates=4),
]


def stop_for(min_tokens: int | None, eos: int) -> StopCriteria:
    return StopCriteria(40, frozenset({eos}), min_tokens or 0)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_lookahead_equals_greedy_with_the_same_settings(tiny_model, name):
    sampling, min_tokens = SETTINGS[name]
    accepted = 0
    for prompt, config in itertools.product(PROMPTS, CONFIGS):
        eos = prompt[-1]  # a token the model likes to repeat: min_tokens matters
        stop = stop_for(min_tokens, eos)
        expected = tokens_of(generate_autoregressive(tiny_model, prompt, stop, sampling))
        steps = list(generate_lookahead(tiny_model, prompt, stop, sampling, config))
        assert tokens_of(steps) == expected, (prompt, config)
        accepted += sum(step.stats.accepted for step in steps)
        if min_tokens is not None:
            assert len(expected) >= min_tokens
    assert accepted > 0, "multi-token steps must happen"


def test_settings_change_the_greedy_output(tiny_model):
    """The equality above is only meaningful if the settings do change the text."""
    stop = StopCriteria(40)
    plain = tokens_of(generate_autoregressive(tiny_model, PROMPTS[0], stop))
    for name in ("presence", "frequency", "repetition", "logit-bias"):
        sampling = SETTINGS[name][0]
        assert tokens_of(generate_autoregressive(tiny_model, PROMPTS[0], stop, sampling)) != plain, name


def exact_penalised_distribution(model, prompt: list[int], sampling: SamplingParams) -> dict:
    """P(x1, x2 | prompt) with ``sampling``'s penalties, by plain forwards."""
    stop = StopCriteria(2)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1:]
        root = warp(adjust_logits(logits, sampling, stop, prompt, len(prompt), [()]), sampling)[0]
        joint = {}
        for first, p_first in enumerate(root.tolist()):
            logits = model(torch.tensor([[*prompt, first]])).logits[0, -1:]
            after = warp(adjust_logits(logits, sampling, stop, [*prompt, first], len(prompt), [()]), sampling)[0]
            for second, p_second in enumerate(after.tolist()):
                joint[(first, second)] = p_first * p_second
    return joint


def test_lookahead_sampling_with_a_penalty_matches_the_exact_distribution():
    model = tiny_vocab_model()
    prompt = [0, 1, 2, 0, 1, 3, 0, 1, 2, 4, 5, 0, 1]
    config = LookaheadConfig(window_size=2, ngram_size=3, guess_set_size=3, copy_length=4, copy_min_match=1,
                             copy_candidates=3)
    penalised = SamplingParams(temperature=1.0, frequency_penalty=2.0)
    samples, accepted_runs, total = Counter(), 0, 2000
    for seed in range(total):
        params = SamplingParams(temperature=1.0, frequency_penalty=2.0, seed=seed)
        steps = list(generate_lookahead(model, prompt, StopCriteria(2), params, config))
        samples[tuple(tokens_of(steps))] += 1
        accepted_runs += any(step.stats.accepted for step in steps)
    assert accepted_runs > total // 10, "the test must exercise accepted guesses"
    assert goodness_of_fit(samples, exact_penalised_distribution(model, prompt, penalised), total) > P_FLOOR
    unpenalised = exact_penalised_distribution(model, prompt, SamplingParams(temperature=1.0))
    assert goodness_of_fit(samples, unpenalised, total) < P_FLOOR


def test_batched_lookahead_with_settings_equals_greedy(tiny_model):
    """Streams stepped together (small budgets: shrunk steps, chunked prefill) keep their settings' greedy text."""
    from decoding.batch import BatchPolicy
    from tests.decoding.test_batch import run_batch

    sampling, min_tokens = SETTINGS["combined"]
    stops = [stop_for(min_tokens, prompt[-1]) for prompt in PROMPTS]
    pairs = list(zip(PROMPTS, stops, strict=True))
    expected = [tokens_of(generate_autoregressive(tiny_model, p, s, sampling)) for p, s in pairs]
    streams = [generate_lookahead(tiny_model, p, s, sampling, CONFIGS[2]) for p, s in pairs]
    assert run_batch(streams, BatchPolicy(max_step_tokens=24, prefill_chunk=4)) == expected


def test_ignoring_eos_runs_to_max_tokens(tiny_model):
    """``ignore_eos`` is EOS left out of ``stop_token_ids``: the decode runs to ``max_tokens``."""
    prompt = PROMPTS[1]
    eos = tokens_of(generate_autoregressive(tiny_model, prompt, StopCriteria(5)))[1]
    stop = StopCriteria(30, frozenset({eos}))
    stopped = tokens_of(generate_lookahead(tiny_model, prompt, stop, lookahead=CONFIGS[1]))
    ignored = tokens_of(generate_lookahead(tiny_model, prompt, StopCriteria(30), lookahead=CONFIGS[1]))
    assert len(stopped) < 30 and len(ignored) == 30 and eos in ignored
