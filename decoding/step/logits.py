"""Logit adjustments that depend on the tokens before a position: penalties, logit bias, ``min_tokens``.

Contract: ``adjust_logits(logits, sampling, stop, tokens, prompt_length, paths)`` returns float32 logits
``[rows, vocab]`` where row ``r`` was adjusted as if the text so far were ``tokens`` (the committed tokens,
prompt first, ``last`` included) followed by ``paths[r]`` (the guessed tokens between ``last`` and that row's
position: ``()`` for ``last``'s own row, a token-tree node's path for the node's row). Counts of the committed
tokens are taken once per call; each row only adds its few path tokens. In order: ``repetition_penalty`` over
prompt + output, ``frequency_penalty`` / ``presence_penalty`` over the output's counts, ``logit_bias`` (ids
outside the vocabulary ignored), then the stop tokens masked to ``-inf`` on rows with fewer than
``stop.min_tokens`` generated tokens before them. ``needs_adjusting`` says whether any of that applies; a
step skips the call entirely when not. The autoregressive loop and lookahead call the same function, so greedy
lookahead stays equal to the greedy loop with the same settings, and sampling keeps its distribution.

Example: tokens ``[5, 6]`` with prompt_length 1 and ``frequency_penalty=1``: row ``()`` subtracts 1 from token 6;
row ``(6, 6)`` subtracts 3 from token 6.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decoding.params import SamplingParams, StopCriteria


def needs_adjusting(sampling: SamplingParams, stop: StopCriteria, generated: int) -> bool:
    """True when some row after ``generated`` output tokens could be changed (penalty, bias or ``min_tokens``)."""
    return sampling.adjusts_logits or (generated < stop.min_tokens and bool(stop.stop_token_ids))


def adjust_logits(
    logits: torch.Tensor,
    sampling: SamplingParams,
    stop: StopCriteria,
    tokens: Sequence[int],
    prompt_length: int,
    paths: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Adjusted float32 copy of ``logits`` ``[rows, vocab]``, row r after ``tokens + paths[r]`` (module contract)."""
    rows, vocab = logits.shape
    device = logits.device
    scores = logits.float().clone()  # [R, V]
    path_rows = torch.tensor([r for r, path in enumerate(paths) for _ in path], dtype=torch.long, device=device)
    path_tokens = torch.tensor([t for path in paths for t in path], dtype=torch.long, device=device)
    if sampling.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(list(tokens), dtype=torch.long, device=device)] = True
        seen = seen.expand(rows, vocab).clone()  # [R, V]
        seen[path_rows, path_tokens] = True
        penalised = torch.where(scores > 0, scores / sampling.repetition_penalty, scores * sampling.repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if sampling.frequency_penalty or sampling.presence_penalty:
        output = torch.tensor(list(tokens[prompt_length:]), dtype=torch.long, device=device)
        counts = torch.bincount(output, minlength=vocab).float().expand(rows, vocab).clone()  # [R, V]
        counts.index_put_((path_rows, path_tokens), torch.ones_like(path_tokens, dtype=torch.float), accumulate=True)
        scores -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0).float()
    bias = [(token, value) for token, value in sampling.logit_bias if 0 <= token < vocab]
    if bias:
        ids = torch.tensor([token for token, _ in bias], dtype=torch.long, device=device)
        scores[:, ids] += torch.tensor([value for _, value in bias], dtype=torch.float, device=device)
    generated = len(tokens) - prompt_length
    early = [r for r, path in enumerate(paths) if generated + len(path) < stop.min_tokens]
    stops = [token for token in sorted(stop.stop_token_ids) if 0 <= token < vocab]
    if early and stops:
        early_rows = torch.tensor(early, dtype=torch.long, device=device)
        scores[early_rows.unsqueeze(1), torch.tensor(stops, dtype=torch.long, device=device)] = float("-inf")
    return scores
