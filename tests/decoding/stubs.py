"""A stub causal LM whose logits are a fixed function of the input token: verification made predictable."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch


class StubLM(torch.nn.Module):
    """Predicts ``next_token(t)`` after token ``t`` with certainty, whatever the context.

    It honours the model contract the engine relies on: ``forward(input_ids, position_ids, attention_mask,
    past_key_values, use_cache, logits_to_keep, packed)`` appends one KV entry per input token to the cache and
    returns logits only for the kept rows.
    """

    def __init__(self, vocab_size: int, next_token: Callable[[int], int], context: int = 512) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.next_token = next_token
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        text = SimpleNamespace(num_hidden_layers=1, max_position_embeddings=context)
        self.config = SimpleNamespace(get_text_config=lambda decoder=True: text)
        self.generation_config = SimpleNamespace(eos_token_id=None)
        self.forward_calls = 0

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def forward(self, input_ids, past_key_values=None, logits_to_keep=0, packed=None, **_):
        self.forward_calls += 1
        count = input_ids.shape[1]
        states = torch.zeros(1, 1, count, 1)
        if packed is not None:  # a packed forward: each slice's KV goes to its own cache
            for _part in packed.update(0, states, states):
                pass
        else:
            past_key_values.update(states, states, 0)
        targets = torch.tensor([self.next_token(int(t)) for t in input_ids[0]])
        logits = torch.nn.functional.one_hot(targets, self.vocab_size).float().unsqueeze(0) * 10.0
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        elif logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)


def cycle_model(period: int = 8, vocab_size: int = 16) -> StubLM:
    """A stub that walks the cycle 0 -> 1 -> ... -> period-1 -> 0."""
    return StubLM(vocab_size, lambda token: (token + 1) % period)
