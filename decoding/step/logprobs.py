"""Per-token log probabilities of committed tokens, read off the logits rows that predicted them.

Contract: ``token_logprobs(logits, rows, tokens, top)`` returns one ``TokenLogprob`` per token: the
``log_softmax`` (float32) of the raw model logits row ``rows[i]`` at ``tokens[i]``, and that row's ``top``
most likely ``(token id, logprob)`` pairs, best first. Raw means before temperature, top-k and top-p: the
model's own distribution, as OpenAI reports it (and vLLM by default), whatever the sampling settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's logprob under the model, and the ``top`` alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], top: int
) -> list[TokenLogprob]:
    """Logprobs of ``tokens`` at logit rows ``rows`` of ``logits`` ``[kept rows, vocab]`` (module contract).

    Example: rows ``[0, 3]``, tokens ``[7, 9]``: token 7 read at row 0 (the step's ``last``), 9 at row 3.
    """
    if not tokens:
        return []
    selected = logits[torch.tensor(list(rows[: len(tokens)]), device=logits.device)].float()  # [T, vocab]
    logprobs = torch.log_softmax(selected, dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(list(tokens), device=logits.device).unsqueeze(-1)).squeeze(-1)
    chosen_list = chosen.tolist()
    if top > 0:
        values, indices = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
        tops = [tuple(zip(ids, vals, strict=True)) for ids, vals in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(tokens)
    return [
        TokenLogprob(int(token), float(value), pairs)
        for token, value, pairs in zip(tokens, chosen_list, tops, strict=True)
    ]
