"""Per-token logprobs: lookahead's (multi-token and copy steps, batched too) equal the autoregressive loop's."""

from __future__ import annotations

import itertools

import pytest
import torch

from decoding.batch import BatchEngine, BatchPolicy
from decoding.errors import InvalidParameterError
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.step.logprobs import token_logprobs
from decoding.step.stream import generate_autoregressive, generate_lookahead
from tests.decoding.step.test_stream import PROMPTS

TOLERANCE = 1e-4
TOP = 5
GREEDY_LOGPROBS = SamplingParams(top_logprobs=TOP)
GRID = list(itertools.product([1, 2, 4], [2, 3, 5], [1, 3]))
COPY_CONFIGS = [
    LookaheadConfig(1, 3, 2, copy_length=16, copy_min_match=1, copy_candidates=3),
    LookaheadConfig(5, 4, 5, copy_length=32, copy_min_match=1, copy_candidates=3),
    LookaheadConfig(1, 3, 2, lazy_window=True, break_even=0.85, copy_length=16, copy_min_match=1, copy_candidates=4),
]


def flatten(steps, with_stop: bool = False) -> tuple[list[int], list]:
    """The tokens and logprobs of a run, checking that every step's logprobs align with its tokens (and its stop
    token's, last, when it ended at one); ``with_stop`` keeps the stop token and its logprob at the end."""
    tokens, logprobs = [], []
    for step in steps:
        stop = [] if step.stop_token is None else [step.stop_token]
        assert step.logprobs is not None and [entry.token_id for entry in step.logprobs] == step.token_ids + stop
        tokens += step.token_ids + (stop if with_stop else [])
        logprobs += step.logprobs if with_stop else step.logprobs[: len(step.token_ids)]
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
    """A stop token inside an accepted run cuts the logprobs with the tokens, its own logprob listed last."""
    prompt = PROMPTS[0]
    tokens, _ = autoregressive(tiny_model, prompt, 40)
    stop = StopCriteria(17, frozenset({tokens[12]}))
    steps = list(generate_lookahead(tiny_model, prompt, stop, GREEDY_LOGPROBS, LookaheadConfig(4, 4, 4)))
    stopped_tokens, logprobs = flatten(steps, with_stop=True)  # the stop token's logprob comes last
    assert stopped_tokens == tokens[: tokens.index(tokens[12]) + 1] and steps[-1].stop_token == tokens[12]
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


@torch.inference_mode()
def full_forward_prompt_logprobs(model, prompt: list[int], top: int = TOP):
    """The reference of prompt logprobs: one plain forward over the prompt, token i read at row i - 1."""
    logits = model(torch.tensor([prompt])).logits[0]
    return token_logprobs(logits, range(len(prompt) - 1), prompt[1:], top)


def prefill_prompt_logprobs(steps) -> list:
    """The prompt logprobs of a run's steps, checking that prefill steps and only they carry them."""
    found = []
    for step in steps:
        assert (step.prompt_logprobs is not None) == step.stats.prefill
        found += step.prompt_logprobs or []
    return found


@pytest.mark.parametrize("prefill_chunk", [3, 128])
def test_prompt_logprobs_equal_a_full_forward_with_chunked_prefill(tiny_model, prefill_chunk):
    """Prompt logprobs read chunk by chunk (batched with another stream, so the prefill really is chunked)
    equal one forward over the whole prompt; the completion and its own logprobs are unchanged."""
    sampling = SamplingParams(top_logprobs=TOP, prompt_logprobs=TOP)
    engine = BatchEngine(tiny_model, BatchPolicy(max_step_tokens=16, prefill_chunk=prefill_chunk))
    engine.add("other", PROMPTS[1], StopCriteria(30), GREEDY_LOGPROBS, LookaheadConfig(2, 3, 2))
    for index, prompt in enumerate(PROMPTS):
        engine.add(index, prompt, StopCriteria(12), sampling, LookaheadConfig(4, 4, 4) if index % 2 else None)
    outputs: dict = {}
    while engine.has_work:
        for request_id, step in engine.step():
            assert not isinstance(step, BaseException), step
            outputs.setdefault(request_id, []).append(step)
    for index, prompt in enumerate(PROMPTS):
        steps = outputs[index]
        if prefill_chunk < len(prompt):
            assert sum(step.stats.prefill for step in steps) > 1  # the prompt took several chunks
        prompt_logprobs = prefill_prompt_logprobs(steps)
        assert [entry.token_id for entry in prompt_logprobs] == prompt[1:]
        assert_same_logprobs(prompt_logprobs, full_forward_prompt_logprobs(tiny_model, prompt))
        tokens, logprobs = flatten(steps)
        reference_tokens, reference = autoregressive(tiny_model, prompt, 12)
        assert tokens == reference_tokens
        assert_same_logprobs(logprobs, reference)
    assert all(step.prompt_logprobs is None for step in outputs["other"])


def test_max_tokens_zero_prefills_only(tiny_model):
    """``max_tokens`` 0: one prefill step, no token, finish "length", the prompt's logprobs when asked."""
    prompt = PROMPTS[0]
    steps = list(generate_lookahead(tiny_model, prompt, StopCriteria(0), SamplingParams(prompt_logprobs=2)))
    assert [step.token_ids for step in steps] == [[]] and steps[0].finish_reason == "length"
    assert_same_logprobs(steps[0].prompt_logprobs, full_forward_prompt_logprobs(tiny_model, prompt, 2))
    [plain] = list(generate_autoregressive(tiny_model, prompt, StopCriteria(0)))
    assert plain.token_ids == [] and plain.finish_reason == "length" and plain.prompt_logprobs is None


def test_long_prompts_read_their_logprobs_in_bounded_chunks(tiny_model, monkeypatch):
    """A lone stream asks for at most ``PROMPT_LOGPROBS_CHUNK`` prompt rows per forward."""
    from decoding.step import stream

    monkeypatch.setattr(stream, "PROMPT_LOGPROBS_CHUNK", 4)
    prompt = PROMPTS[0] * 3
    steps = list(generate_autoregressive(tiny_model, prompt, StopCriteria(2), SamplingParams(prompt_logprobs=0)))
    prefills = [step for step in steps if step.stats.prefill]
    assert len(prefills) == -(-len(prompt) // 4) and all(step.stats.input_tokens <= 4 for step in prefills)
    assert_same_logprobs(prefill_prompt_logprobs(steps), full_forward_prompt_logprobs(tiny_model, prompt, 0))
