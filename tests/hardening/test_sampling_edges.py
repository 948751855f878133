"""Found by the fuzzer: denormal ``temperature`` / ``top_p`` (valid values that float32 rounds to 0) made
``warp`` return NaN and the worker fail the request with a 500. Every valid setting must give a distribution."""

from __future__ import annotations

import pytest
import torch

from decoding.params import SamplingParams
from decoding.step.sampling import warp

EDGES = [(5e-324, 1.0), (1e-45, 0.9), (1.0, 5e-324), (2.0, 1e-45), (5e-324, 5e-324), (1e-30, 1e-30), (2.0, 1.0)]


@pytest.mark.parametrize("temperature, top_p", EDGES)
def test_warp_gives_a_distribution_for_every_valid_setting(temperature, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 64) * 8  # [rows, vocab]
    probs = warp(logits, SamplingParams(temperature=temperature, top_p=top_p, top_k=5 if top_p < 1 else 0))
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(dim=-1), torch.ones(3))
    assert (probs.argmax(dim=-1) == logits.argmax(dim=-1)).all()  # the best token always survives


@pytest.mark.parametrize("temperature, top_p", [(5e-324, 1.0), (1.0, 5e-324)])
def test_vanishing_settings_are_the_greedy_limit(temperature, top_p):
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    probs = warp(logits, SamplingParams(temperature=temperature, top_p=top_p))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
