"""Sampling: per-position samples keep the target distribution; a seed gives the same tokens whatever the decoding."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from unittest.mock import patch

import numpy
import pytest
import torch
from scipy.stats import chisquare, kstest
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.batch import BatchEngine, BatchPolicy
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.proposers.ngram_memory import NGramMemory
from decoding.step.sampling import GOLDEN32, MASK32, SampledRows, gumbel, mix32, row_key, sample_rows, warp, warp_scores
from decoding.step.stream import generate_autoregressive, generate_lookahead
from decoding.step.tree import TokenTree
from decoding.step.verify import verify_greedy

P_FLOOR = 1e-3


def goodness_of_fit(observed: Counter, expected_probs: dict, total: int) -> float:
    """Chi-square p-value of ``observed`` counts against ``expected_probs``, pooling cells expected < 5."""
    cells = sorted(expected_probs, key=lambda cell: expected_probs[cell])
    observed_counts, expected_counts, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for cell in cells:
        expected = expected_probs[cell] * total
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + observed.get(cell, 0), pooled_exp + expected
            continue
        observed_counts.append(observed.get(cell, 0))
        expected_counts.append(expected)
    if pooled_exp > 0:
        observed_counts.append(pooled_obs)
        expected_counts.append(pooled_exp)
    scale = sum(observed_counts) / sum(expected_counts)
    return float(chisquare(observed_counts, [value * scale for value in expected_counts]).pvalue)


def test_the_device_noise_is_the_reference_hash_and_gumbel_distributed():
    keys = [row_key(seed, index) for seed in (0, -1, 2**63 - 1) for index in (0, 1, 999)]
    noise = gumbel(keys, 5000, torch.device("cpu")).double()
    for row, key in enumerate(keys):
        for token in (0, 1, 4321, 4999):
            uniform = (mix32(mix32((token * GOLDEN32) & MASK32) ^ key) + 0.5) / 2**32
            assert abs(noise[row, token].item() + math.log(-math.log(uniform))) < 1e-5
    assert len(set(keys)) == len(keys)
    assert kstest(noise[0].tolist(), "gumbel_r").pvalue > P_FLOOR
    assert kstest(noise[:, 7].tolist() + noise[:, 8].tolist(), "gumbel_r").pvalue > P_FLOOR
    assert abs(numpy.corrcoef(noise[0], noise[1])[0, 1]) < 0.05  # rows are not alike


def test_a_perturbed_argmax_samples_the_row_distribution_and_never_a_zero():
    probs = torch.tensor([[0.1, 0.0, 0.45, 0.05, 0.4]])
    sampling = SamplingParams(temperature=1.0)
    total = 8000
    drawn = Counter(sample_rows(probs.log(), sampling, seed, [3])[0] for seed in range(total))
    assert drawn[1] == 0
    assert goodness_of_fit(drawn, dict(enumerate(probs[0].tolist())), total) > P_FLOOR


def test_sampled_verification_keeps_each_conditional_and_accepts_with_the_guess_probability():
    """The greedy walk over per-position samples: the run's first token follows the root, each later token the
    row of the accepted path; a guess is accepted with its probability (several distinct guesses: their sum)."""
    p_root = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0])
    q_after_1 = torch.tensor([0.3, 0.0, 0.5, 0.1, 0.1])
    q_after_3 = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])
    r_after_12 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    r_after_13 = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5])
    r_after_30 = torch.tensor([0.1, 0.1, 0.1, 0.6, 0.1])
    candidates = [(1, 2), (1, 3), (3, 0)]
    tree = TokenTree.build(candidates)  # nodes: 1, 2, 3, 3', 0
    rows = [p_root, q_after_1, r_after_12, r_after_13, q_after_3, r_after_30]  # root, then one row per node
    scores = torch.stack(rows).log()
    indices = {0: 0, **{1 + node: depth for node, depth in enumerate(tree.depths)}}
    sampling = SamplingParams(temperature=1.0)

    def row(candidate: int, k: int) -> int:
        return 1 + tree.paths[candidate][k]

    total = 20000
    runs = [verify_greedy(SampledRows(scores, sampling, seed, indices), candidates, row).tokens
            for seed in range(total)]
    first = Counter(tokens[0] for tokens in runs)
    assert goodness_of_fit(first, dict(enumerate(p_root.tolist())), total) > P_FLOOR
    for prefix, target in [((1,), q_after_1), ((3,), q_after_3), ((1, 2), r_after_12), ((1, 3), r_after_13)]:
        following = [tokens[len(prefix)] for tokens in runs if tuple(tokens[: len(prefix)]) == prefix]
        assert len(following) > 500
        p_value = goodness_of_fit(Counter(following), dict(enumerate(target.tolist())), len(following))
        assert p_value > P_FLOOR, prefix
    # the first guess is accepted with P[1] + P[3] = 0.7 (two distinct guessed tokens), as the rejection rule did
    accepted = sum(len(tokens) > 1 for tokens in runs) / total
    assert abs(accepted - 0.7) < 4 * (0.7 * 0.3 / total) ** 0.5
    assert any(len(tokens) == 3 for tokens in runs) and first[2] > 0


def tiny_vocab_model() -> LlamaForCausalLM:
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=6,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharpen: guesses get accepted often, yet every token stays possible
    return model


def exact_two_token_distribution(model, prompt: list[int], sampling: SamplingParams) -> dict:
    """P(x1, x2 | prompt) under ``sampling``'s warped distribution, by plain forwards."""
    with torch.inference_mode():
        root = warp(model(torch.tensor([prompt])).logits[0, -1:], sampling)[0]
        joint = {}
        for first, p_first in enumerate(root.tolist()):
            after = warp(model(torch.tensor([[*prompt, first]])).logits[0, -1:], sampling)[0]
            for second, p_second in enumerate(after.tolist()):
                joint[(first, second)] = p_first * p_second
    return joint


@pytest.mark.parametrize(
    "sampling, copy_length, copies, sources",
    [
        (SamplingParams(temperature=1.0), 0, 1, {}),
        (SamplingParams(temperature=0.8, top_p=0.9, top_k=4), 0, 1, {}),
        (SamplingParams(temperature=1.5, min_p=0.1), 0, 1, {}),
        (SamplingParams(temperature=1.0), 4, 1, {}),
        (SamplingParams(temperature=1.0), 4, 3, {}),
        (SamplingParams(temperature=1.0), 0, 1, {"recycled": 4, "runner_up": 2}),
    ],
    ids=["plain", "warped", "min-p", "copy-steps", "copy-tree", "recycled-runner-up"],
)
def test_lookahead_sampling_matches_the_exact_joint_distribution(sampling, copy_length, copies, sources):
    model = tiny_vocab_model()
    prompt = [0, 1, 2, 0, 1, 3, 0, 1, 2, 4, 5, 0, 1]
    # copy_min_match 1: this short prompt repeats 2-token contexts only
    config = LookaheadConfig(
        window_size=2, ngram_size=3, guess_set_size=3, copy_length=copy_length, copy_min_match=1,
        copy_candidates=copies, **sources,
    )
    samples, accepted_runs, copy_steps = Counter(), 0, 0
    total = 2000
    for seed in range(total):
        params = replace(sampling, seed=seed)
        steps = list(generate_lookahead(model, prompt, StopCriteria(2), params, config))
        tokens = [token for step in steps for token in step.token_ids]
        samples[tuple(tokens)] += 1
        accepted_runs += any(step.stats.accepted for step in steps)
        copy_steps += sum(step.stats.offered > config.levels for step in steps)
    assert accepted_runs > total // 10, "the test must exercise accepted guesses"
    assert (copy_steps > total // 10) == (copy_length > 0), "copy steps run exactly when they are on"
    exact = exact_two_token_distribution(model, prompt, sampling)
    assert goodness_of_fit(samples, exact, total) > P_FLOOR
    # power check: the same samples are rejected against a visibly different distribution
    other = SamplingParams(temperature=sampling.temperature * 2.0)
    assert goodness_of_fit(samples, exact_two_token_distribution(model, prompt, other), total) < P_FLOOR


# Lookahead at several shapes: the window alone, copies, a lazy window with copies (the CPU preset's kind), chains
# off by construction (they verify greedy steps only).
SEEDED_CONFIGS = [
    LookaheadConfig(3, 3, 3),
    LookaheadConfig(5, 4, 5, copy_length=4, copy_min_match=1),
    LookaheadConfig(1, 4, 3, lazy_window=True, copy_length=8, copy_min_match=1, copy_candidates=2),
    LookaheadConfig(3, 4, 4, recycled=4, runner_up=2),  # the sources that read the rows' top tokens
]
SEEDED_SAMPLINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.5),
]
REPEATING_PROMPT = [0, 1, 2, 0, 1, 3, 0, 1, 2, 4, 5, 0, 1]


def sampled_tokens(model, prompt, sampling, config, max_tokens=24) -> tuple[list[int], int]:
    """The tokens of one decode alone (``config`` None: the plain loop) and the guesses it accepted."""
    stop = StopCriteria(max_tokens)
    if config is None:
        steps = list(generate_autoregressive(model, prompt, stop, sampling))
    else:
        steps = list(generate_lookahead(model, prompt, stop, sampling, config))
    return [token for step in steps for token in step.token_ids], sum(step.stats.accepted for step in steps)


@pytest.mark.parametrize("sampling", SEEDED_SAMPLINGS, ids=["plain", "warped-penalised"])
def test_a_seed_gives_the_same_tokens_with_lookahead_on_or_off_at_any_shape(sampling):
    model = tiny_vocab_model()
    accepted = 0
    for seed in range(12):
        seeded = replace(sampling, seed=seed)
        reference, _ = sampled_tokens(model, REPEATING_PROMPT, seeded, None)
        for config in SEEDED_CONFIGS:
            tokens, taken = sampled_tokens(model, REPEATING_PROMPT, seeded, config)
            assert tokens == reference, (seed, config)
            accepted += taken
    assert accepted > 100, "the equality must hold over accepted guesses, not only plain steps"
    others = {tuple(sampled_tokens(model, REPEATING_PROMPT, replace(sampling, seed=seed), None)[0])
              for seed in range(12)}
    assert len(others) > 6, "different seeds give different texts"


def test_a_seed_gives_the_same_tokens_batched_with_other_traffic_and_a_warm_memory(tiny_model):
    """The same seeded request through one engine with a shared memory: alone first (memory cold), then beside
    other requests, twice more (the memory warm with its own earlier outputs): always the plain loop's tokens."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10]]
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    references = {index: sampled_tokens(tiny_model, prompt, replace(sampling, seed=100 + index), None, 40)[0]
                  for index, prompt in enumerate(prompts)}
    engine = BatchEngine(tiny_model, BatchPolicy(max_step_tokens=24, prefill_chunk=4), memory=NGramMemory(2000))
    for round_ in range(3):
        config = SEEDED_CONFIGS[round_ % len(SEEDED_CONFIGS)]
        outputs = {}
        for index, prompt in enumerate(prompts if round_ else prompts[:1]):
            engine.add((round_, index), prompt, StopCriteria(40), replace(sampling, seed=100 + index), config)
            engine.add((round_, index, "other"), prompt[::-1], StopCriteria(20), SamplingParams(temperature=1.0),
                       config)
        while engine.has_work:
            for request_id, step in engine.step():
                assert not isinstance(step, BaseException), step
                outputs.setdefault(request_id, []).extend(step.token_ids)
        for index in range(len(prompts) if round_ else 1):
            assert outputs[(round_, index)] == references[index], (round_, index)
    assert engine.memory.documents >= 4


def test_an_unseeded_stream_draws_a_seed_that_replays_it(tiny_model):
    stream = generate_lookahead(tiny_model, [1, 2, 3], StopCriteria(20), SamplingParams(temperature=1.0),
                                SEEDED_CONFIGS[0])
    tokens = [token for step in stream for token in step.token_ids]
    assert isinstance(stream.seed, int)
    replay = SamplingParams(temperature=1.0, seed=stream.seed)
    assert sampled_tokens(tiny_model, [1, 2, 3], replay, None, 20)[0] == tokens
    assert generate_autoregressive(tiny_model, [1, 2, 3], StopCriteria(1)).seed is None  # greedy: no seed


def test_top_p_found_among_the_likeliest_tokens_equals_the_full_sort():
    """The CPU's partial sorts (64, then 1024 tokens) keep the nucleus a full sort keeps, narrow or wide."""
    generator = torch.Generator().manual_seed(0)
    for spread in (0.5, 3.0, 12.0):
        logits = torch.randn(3, 5000, generator=generator) * spread
        for top_p in (0.0, 0.3, 0.9, 0.99):
            sampling = SamplingParams(temperature=1.0, top_p=top_p)
            kept = ~torch.isinf(warp_scores(logits, sampling))
            with patch("decoding.step.sampling.NUCLEUS_WIDTHS", ()):
                assert torch.equal(kept, ~torch.isinf(warp_scores(logits, sampling))), (spread, top_p)


def test_rows_sampled_together_equal_rows_sampled_one_by_one():
    scores = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    indices = {row: 10 + row for row in range(6)}
    together = SampledRows(scores, sampling, 5, indices)
    together.prefetch(range(6))
    alone = SampledRows(scores, sampling, 5, indices)
    assert [together[row] for row in range(6)] == [alone[row] for row in range(6)]
