"""Lookahead == greedy == transformers.generate on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import pytest
import torch

from decoding.decoder import Decoder
from decoding.params import LookaheadConfig, StopCriteria

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MESSAGES = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three tips for writing clear emails.",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
]


def prompt_ids(tokenizer, text: str) -> list[int]:
    if text.startswith("def "):
        return tokenizer(text)["input_ids"]
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def decode(decoder: Decoder, ids: list[int], lookahead: LookaheadConfig | None, max_tokens: int) -> list[int]:
    stop = StopCriteria(max_tokens, decoder.eos_token_ids())
    return [token for step in decoder.decode(ids, stop, lookahead=lookahead) for token in step.token_ids]


@pytest.fixture(scope="module")
def greedy_outputs(real_model) -> dict[str, tuple[list[int], list[int]]]:
    """Prompt ids and the greedy continuation (40 tokens) of each message, computed once."""
    decoder = Decoder(real_model)
    outputs = {}
    for text in MESSAGES:
        ids = prompt_ids(real_model.tokenizer, text)
        outputs[text] = (ids, decode(decoder, ids, None, 40))
    return outputs


def test_greedy_loop_equals_transformers_generate(real_model, greedy_outputs):
    decoder = Decoder(real_model)
    ids, ours = greedy_outputs[MESSAGES[0]]
    with torch.inference_mode():
        output = real_model.model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
    theirs = [token for token in output[0, len(ids) :].tolist() if token not in decoder.eos_token_ids()]
    assert ours == theirs


@pytest.mark.parametrize("config", [LookaheadConfig(2, 4, 4), LookaheadConfig(7, 5, 7)], ids=["2-4-4", "7-5-7"])
def test_lookahead_equals_greedy_on_the_real_model(real_model, greedy_outputs, config):
    decoder = Decoder(real_model)
    for text, (ids, expected) in greedy_outputs.items():
        assert decode(decoder, ids, config, 40) == expected, text
