"""Predicted outputs: a request's prediction seeds lookahead's copies; it changes speed, never greedy output."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from decoding.batch import BatchEngine, BatchPolicy
from decoding.params import LookaheadConfig, StopCriteria
from decoding.step.stream import PREDICTION_COPY_LENGTH, DecodeStream, StepCounts, generate_autoregressive
from tests.decoding.stubs import cycle_model

PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 5, 7, 3, 2, 5, 7], [10, 11, 12, 13], [42]]
CONFIGS = [
    LookaheadConfig(1, 2, 0),
    LookaheadConfig(2, 4, 3, lazy_window=True, break_even=0.5),
    LookaheadConfig(1, 3, 2, lazy_window=True, break_even=0.85, copy_length=16, copy_min_match=1),
    LookaheadConfig(5, 4, 5, copy_length=32, copy_min_match=2, copy_candidates=3),
    LookaheadConfig(3, 4, 3, rank_by_context=False),
]
IDS = ["degenerate", "lazy", "copy-lazy", "copy-tree", "pool-only"]


def tokens_of(steps) -> list[int]:
    return [token for step in steps for token in step.token_ids]


def greedy(model, prompt, stop) -> list[int]:
    return tokens_of(generate_autoregressive(model, prompt, stop))


def decode(model, prompt, stop, config, prediction=None) -> list:
    return list(DecodeStream(model, prompt, stop, lookahead=config, prediction=prediction))


def wrong(tokens: list[int], seed: int = 0) -> list[int]:
    """``tokens`` with every fifth one changed: a prediction that matches in stretches, then diverges."""
    rng = random.Random(seed)
    return [rng.randrange(64) if index % 5 == 4 else token for index, token in enumerate(tokens)]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_prediction_never_changes_greedy_output(tiny_model, config):
    stop = StopCriteria(max_tokens=60)
    for prompt in PROMPTS:
        expected = greedy(tiny_model, prompt, stop)
        for prediction in (None, expected, wrong(expected), expected[10:] + expected[:10], prompt, [3]):
            assert tokens_of(decode(tiny_model, prompt, stop, config, prediction)) == expected


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_the_greedy_output_as_prediction_takes_far_fewer_steps(tiny_model, config):
    stop = StopCriteria(max_tokens=100)
    prompt = PROMPTS[1]
    expected = greedy(tiny_model, prompt, stop)
    config = replace(config, copy_min_match=1)
    without = decode(tiny_model, prompt, stop, config)
    predicted = decode(tiny_model, prompt, stop, config, expected)
    assert len(predicted) * 2 < len(without)
    counts = sum((step.stats.counts() for step in predicted), StepCounts())
    assert 0 < counts.prediction_accepted <= counts.accepted  # other sources may propose some of it first
    assert sum((step.stats.counts() for step in without), StepCounts()).prediction_accepted == 0


def test_a_prediction_copy_commits_its_length_plus_one_on_a_stub():
    """The stub counts 0, 1, 2, ...; the prediction holds the right continuation. After the prefill (3) and
    one plain step (4), the pair "3 4" matches the prediction: its next 32 tokens are verified and accepted."""
    model = cycle_model(period=60, vocab_size=64)
    config = LookaheadConfig(1, 2, 0, copy_min_match=1)  # copy steps off: a prediction still copies
    steps = decode(model, [0, 1, 2], StopCriteria(max_tokens=40), config, list(range(3, 50)))
    assert tokens_of(steps) == list(range(3, 43))
    assert [step.stats.committed for step in steps] == [1, 1, PREDICTION_COPY_LENGTH + 1, 5]
    copy = steps[2].stats
    assert (copy.offered, copy.accepted, copy.prediction_accepted) == (32, 32, 32)


def test_where_long_copies_cost_a_prediction_stretches_from_the_copy_length():
    """On a CPU-like curve (a token costs 0.2 accepted guesses: 24 more tokens cost 4.8) the prediction's copies
    start at ``copy_length`` and double after whole copies up to 32 tokens: committed 9, 17, 33; on a flat curve
    they are 32 tokens from the first."""
    model = cycle_model(period=100, vocab_size=128)
    config = LookaheadConfig(1, 2, 0, copy_length=8, copy_min_match=1, prompt_pool=False, output_pool=False)
    steep = BatchPolicy(step_cost=((1, 1.0), (1025, 205.8)))  # 1 + 0.2 a token
    flat = BatchPolicy(step_cost=((1, 1.0), (4096, 1.0)))
    committed = {}
    for name, policy in (("steep", steep), ("flat", flat)):
        engine = BatchEngine(model, policy)
        engine.add(0, [0, 1, 2], StopCriteria(max_tokens=80), lookahead=config, prediction=list(range(3, 100)))
        steps = []
        while engine.has_work:
            steps.extend(step for _, step in engine.step())
        assert tokens_of(steps) == list(range(3, 83))
        committed[name] = [step.stats.committed for step in steps if step.stats.prediction_accepted]
    assert committed["steep"][:3] == [9, 17, 33]
    assert committed["flat"][0] == PREDICTION_COPY_LENGTH + 1


def test_a_prediction_is_ignored_without_lookahead(tiny_model):
    stop = StopCriteria(max_tokens=30)
    expected = greedy(tiny_model, PROMPTS[0], stop)
    steps = list(DecodeStream(tiny_model, PROMPTS[0], stop, prediction=expected))
    assert tokens_of(steps) == expected and len(steps) == len(expected)


def test_batched_predictions_keep_greedy_output_and_save_steps(tiny_model):
    stop = StopCriteria(max_tokens=80)
    config = LookaheadConfig(2, 3, 2, lazy_window=True, copy_length=16, copy_min_match=1)
    expected = {str(index): greedy(tiny_model, prompt, stop) for index, prompt in enumerate(PROMPTS)}
    steps = {}
    for with_prediction in (False, True):
        engine = BatchEngine(tiny_model, BatchPolicy(max_step_tokens=64, prefill_chunk=8))
        for index, prompt in enumerate(PROMPTS):
            name = str(index)
            prediction = expected[name] if with_prediction and index != 2 else wrong(expected[name])
            engine.add(name, prompt, stop, lookahead=config, prediction=prediction)
        outputs: dict[str, list[int]] = {name: [] for name in expected}
        rounds = 0
        while engine.has_work:
            rounds += 1
            for name, step in engine.step():
                outputs[name] += step.token_ids
        assert outputs == expected
        steps[with_prediction] = rounds
    assert steps[True] < steps[False]
