"""Sampling: lookahead verification preserves the target distribution; seeds reproduce outputs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.engine import generate_autoregressive, generate_lookahead
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.verify import verify_sampling, warp

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


def test_verify_sampling_preserves_each_conditional_distribution():
    p_root = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0])
    q_after_1 = torch.tensor([0.3, 0.0, 0.5, 0.1, 0.1])
    q_after_3 = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])
    r_after_12 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    r_after_13 = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5])
    r_after_30 = torch.tensor([0.1, 0.1, 0.1, 0.6, 0.1])
    candidates = [(1, 2), (1, 3), (3, 0)]
    # rows: 0 = root, then candidate-major: (c0,k0) (c0,k1) (c1,k0) (c1,k1) (c2,k0) (c2,k1)
    probs = torch.stack([p_root, q_after_1, r_after_12, q_after_1, r_after_13, q_after_3, r_after_30])

    def row(candidate: int, k: int) -> int:
        return 1 + candidate * 2 + k

    generator = torch.Generator().manual_seed(0)
    runs = [verify_sampling(probs, candidates, row, generator).tokens for _ in range(20000)]
    first = Counter(tokens[0] for tokens in runs)
    assert goodness_of_fit(first, dict(enumerate(p_root.tolist())), len(runs)) > P_FLOOR
    for prefix, target in [((1,), q_after_1), ((3,), q_after_3), ((1, 2), r_after_12), ((1, 3), r_after_13)]:
        following = [tokens[len(prefix)] for tokens in runs if tuple(tokens[: len(prefix)]) == prefix]
        assert len(following) > 500
        p_value = goodness_of_fit(Counter(following), dict(enumerate(target.tolist())), len(following))
        assert p_value > P_FLOOR, prefix
    # a multi-token run happens, and a token no candidate proposed still appears at the root
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
    "sampling, copy_length, copies",
    [
        (SamplingParams(temperature=1.0), 0, 1),
        (SamplingParams(temperature=0.8, top_p=0.9, top_k=4), 0, 1),
        (SamplingParams(temperature=1.0), 4, 1),
        (SamplingParams(temperature=1.0), 4, 3),
    ],
    ids=["plain", "warped", "copy-steps", "copy-tree"],
)
def test_lookahead_sampling_matches_the_exact_joint_distribution(sampling, copy_length, copies):
    model = tiny_vocab_model()
    prompt = [0, 1, 2, 0, 1, 3, 0, 1, 2, 4, 5, 0, 1]
    # copy_min_match 1: this short prompt repeats 2-token contexts only
    config = LookaheadConfig(
        window_size=2, ngram_size=3, guess_set_size=3, copy_length=copy_length, copy_min_match=1, copy_candidates=copies
    )
    samples, accepted_runs, copy_steps = Counter(), 0, 0
    total = 2000
    for seed in range(total):
        params = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k, seed=seed)
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
    other = SamplingParams(temperature=sampling.temperature * 2.0, top_p=1.0, top_k=0)
    assert goodness_of_fit(samples, exact_two_token_distribution(model, prompt, other), total) < P_FLOOR


@pytest.mark.parametrize("lookahead", [True, False])
def test_seed_reproduces_the_output(tiny_model, lookahead):
    def run(seed: int) -> list[int]:
        sampling = SamplingParams(temperature=1.0, seed=seed)
        if lookahead:
            steps = generate_lookahead(
                tiny_model, [1, 2, 3, 1, 2], StopCriteria(30), sampling, LookaheadConfig(3, 3, 3)
            )
        else:
            steps = generate_autoregressive(tiny_model, [1, 2, 3, 1, 2], StopCriteria(30), sampling)
        return [token for step in steps for token in step.token_ids]

    assert run(7) == run(7)
    assert run(7) != run(8)
