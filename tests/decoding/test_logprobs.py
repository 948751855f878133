"""Per-token logprobs: lookahead's (multi-token and copy steps, batched too) equal the autoregressive loop's."""

from __future__ import annotations

import itertools

import pytest
import torch

from decoding.batch import BatchEngine, BatchPolicy
from decoding.engine import generate_autoregressive, generate_lookahead
from decoding.errors import InvalidParameterError
from decoding.logprobs import token_logprobs
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from tests.decoding.test_engine import PROMPTS

TOLERANCE = 1e-4
TOP = 5
GREEDY_LOGPROBS = SamplingParams(top_logprobs=TOP)
GRID = list(itertools.product([1, 2, 4], [2, 3, 5], [1, 3]))
COPY_CONFIGS = [
    LookaheadConfig(1, 3, 2, copy_length=16, copy_min_match=1, copy_candidates=3),
    LookaheadConfig(5, 4, 5, copy_length=32, copy_min_match=1, copy_candidates=3),
    LookaheadConfig(1, 3, 2, lazy_window=True, break_even=0.85, copy_length=16, copy_min_match=1, copy_candidates=4),
]


def flatten(steps) -> tuple[list[int], list]:
    """The tokens and logprobs of a run, checking that every step's logprobs align with its tokens."""
    tokens, logprobs = [], []
    for step in steps:
        assert step.logprobs is not None and len(step.logprobs) == len(step.token_ids)
        assert [entry.token_id for entry in step.logprobs] == step.token_ids
        tokens += step.token_ids
        logprobs += step.logprobs
    return tokens, logprobs


def assert_same_logprobs(actual, expected) -> None:
    assert len(actual) == len(expected)
    for mine, reference in zip(actual, expected, strict=True):
        assert mine.token_id == reference.token_id
        assert mine.logprob == pytest.approx(reference.logprob, abs=TOLERANCE)
        assert [token for token, _ in mine.top] == [token for token, _ in reference.top]
        assert [value for _, value in mine.top] == pytest.approx([value for _, value in reference.top], abs=TOLERANCE)


def autoregressive(model, prompt, max_tokens, sampling=GREEDY_LOGPROBS):
    return flatten(generate_autoregressive(model, prompt, StopCriteria(max_tokens), sampling))


@torch.inference_mode()
def full_forward_logprobs(model, prompt: list[int], tokens: list[int], top: int = TOP):
    """The reference of any run: one plain forward over prompt + tokens, each token read at the row before it."""
    logits = model(torch.tensor([prompt + tokens])).logits[0]
    rows = list(range(len(prompt) - 1, len(prompt) + len(tokens) - 1))
    return token_logprobs(logits, rows, tokens, top)


def test_autoregressive_logprobs_equal_a_full_forward(tiny_model):
    for prompt in PROMPTS:
        tokens, logprobs = autoregressive(tiny_model, prompt, 30)
        assert_same_logprobs(logprobs, full_forward_logprobs(tiny_model, prompt, tokens))
        assert all(entry.logprob <= 0 and len(entry.top) == TOP for entry in logprobs)
        assert all(entry.top[0][0] == entry.token_id for entry in logprobs)  # greedy: the best token


@pytest.mark.parametrize("window_size, ngram_size, guess_set_size", GRID)
def test_lookahead_logprobs_equal_autoregressive_over_grid(tiny_model, window_size, ngram_size, guess_set_size):
    config = LookaheadConfig(window_size, ngram_size, guess_set_size)
    multi_token_steps = 0
    for prompt in PROMPTS:
        steps = list(generate_lookahead(tiny_model, prompt, StopCriteria(40), GREEDY_LOGPROBS, config))
        multi_token_steps += sum(len(step.token_ids) > 1 for step in steps)
        tokens, logprobs = flatten(steps)
        reference_tokens, reference = autoregressive(tiny_model, prompt, 40)
        assert tokens == reference_tokens
        assert_same_logprobs(logprobs, reference)
    assert multi_token_steps > 0


@pytest.mark.parametrize("config", COPY_CONFIGS, ids=["copies", "tree-window-copies", "copies-lazy"])
def test_copy_steps_logprobs_equal_autoregressive(tiny_model, config):
    copy_steps = 0
    for prompt in PROMPTS:
        steps = list(generate_lookahead(tiny_model, prompt, StopCriteria(60), GREEDY_LOGPROBS, config))
        copy_steps += sum(step.stats.accepted > config.ngram_size - 1 or step.stats.committed > 2 for step in steps)
        tokens, logprobs = flatten(steps)
        reference_tokens, reference = autoregressive(tiny_model, prompt, 60)
        assert tokens == reference_tokens
        assert_same_logprobs(logprobs, reference)
    assert copy_steps > 0


def test_sampled_lookahead_logprobs_are_the_raw_models(tiny_model):
    """With sampling the tokens differ from greedy's; each logprob is still the unwarped model's at its place."""
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=3, top_logprobs=TOP)
    config = LookaheadConfig(3, 4, 3, copy_length=8, copy_min_match=1, copy_candidates=2)
    for prompt in PROMPTS:
        steps = list(generate_lookahead(tiny_model, prompt, StopCriteria(40), sampling, config))
        tokens, logprobs = flatten(steps)
        assert_same_logprobs(logprobs, full_forward_logprobs(tiny_model, prompt, tokens))


def test_batched_logprobs_equal_each_stream_alone(tiny_model):
    configs = [LookaheadConfig(4, 4, 4), None, COPY_CONFIGS[1], LookaheadConfig(2, 3, 2)]
    engine = BatchEngine(tiny_model, BatchPolicy(max_step_tokens=16, prefill_chunk=4))
    outputs: dict[int, list] = {index: [] for index in range(len(PROMPTS))}
    for index, (prompt, config) in enumerate(zip(PROMPTS, configs, strict=True)):
        engine.add(index, prompt, StopCriteria(40), GREEDY_LOGPROBS, config)
    multi_token_steps = 0
    while engine.has_work:
        for index, step in engine.step():
            assert not isinstance(step, BaseException), step
            outputs[index].append(step)
            multi_token_steps += len(step.token_ids) > 1
    assert multi_token_steps > 0
    for index, prompt in enumerate(PROMPTS):
        tokens, logprobs = flatten(outputs[index])
        reference_tokens, reference = autoregressive(tiny_model, prompt, 40)
        assert tokens == reference_tokens
        assert_same_logprobs(logprobs, reference)


def test_logprobs_stop_where_the_tokens_stop(tiny_model):
    """A stop token or max_tokens inside an accepted run cuts the logprobs with the tokens."""
    prompt = PROMPTS[0]
    tokens, _ = autoregressive(tiny_model, prompt, 40)
    stop = StopCriteria(17, frozenset({tokens[12]}))
    steps = list(generate_lookahead(tiny_model, prompt, stop, GREEDY_LOGPROBS, LookaheadConfig(4, 4, 4)))
    stopped_tokens, logprobs = flatten(steps)
    assert stopped_tokens == tokens[: tokens.index(tokens[12])]
    assert_same_logprobs(logprobs, full_forward_logprobs(tiny_model, prompt, stopped_tokens))


def test_no_logprobs_unless_asked_and_zero_means_no_alternatives(tiny_model):
    steps = list(generate_lookahead(tiny_model, PROMPTS[0], StopCriteria(10), lookahead=LookaheadConfig(4, 4, 4)))
    assert all(step.logprobs is None for step in steps)
    _, logprobs = autoregressive(tiny_model, PROMPTS[0], 10, SamplingParams(top_logprobs=0))
    assert len(logprobs) == 10 and all(entry.top == () for entry in logprobs)


@pytest.mark.parametrize("value", [-1, 21, True, 2.0])
def test_bad_top_logprobs_raise_naming_the_field(tiny_model, value):
    with pytest.raises(InvalidParameterError) as error:
        generate_lookahead(tiny_model, [1, 2], StopCriteria(4), SamplingParams(top_logprobs=value))
    assert error.value.param == "top_logprobs"
