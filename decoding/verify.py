"""Token choice and candidate verification, for greedy decoding and for sampling.

Contract: both verifiers take the step's candidates (lists of guessed tokens, of any lengths) and return a
``Verdict``: which candidate won, how many of its tokens were accepted (``m``), and the committed run (those
``m`` tokens plus one token read off the model at the last accepted position: 1..K+1 tokens, K the longest
candidate's length).

- ``verify_greedy`` is exact: the run equals what greedy decoding would produce.
- ``verify_sampling`` preserves the target distribution: tokens proposed by deterministic drafts are
  accepted with probability ``P[x]``; on rejection ``P[x] = 0`` and ``P`` is renormalised before trying the
  next distinct token (SpecInfer's multi-candidate rule with a point-mass draft).
- ``verify_constrained`` applies either rule under a grammar's masks: it walks the candidates position by
  position, masking each row after the tokens accepted before it, so each mask is computed once per accepted
  token (plus one), never for rows that are not reached.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decoding.grammar import Constraint
from decoding.params import SamplingParams

FLOAT32_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Verdict:
    """Outcome of verification: ``tokens`` = the accepted candidate prefix + one model token."""

    candidate: int | None
    num_accepted: int
    tokens: list[int]


def warp(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Probabilities ``[rows, vocab]`` (float32) after temperature, min-p, top-k and top-p.

    min-p drops tokens less likely than ``min_p`` times the best one (after temperature). top-p keeps the
    smallest set of most likely tokens whose mass reaches ``top_p`` (at least one token; ``top_p == 0``: one).
    Any valid temperature and top-p give a distribution, even denormals such as 5e-324, which float32 rounds
    to 0: scores are shifted so that the best is 0 before dividing (no inf - inf), and the best token always
    survives top-p.
    """
    scores = logits.float()
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / max(sampling.temperature, FLOAT32_TINY)
    vocab = scores.shape[-1]
    if sampling.min_p > 0.0:
        scores = scores.masked_fill(scores < math.log(sampling.min_p), float("-inf"))  # the best scores 0
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        remove = mass_before >= sampling.top_p
        remove[..., 0] = False
        sorted_scores = sorted_scores.masked_fill(remove, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    return scores.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token from a ``[vocab]`` probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def verify_greedy(
    predicted: Sequence[int], candidates: Sequence[Sequence[int]], candidate_row: Callable[[int, int], int]
) -> Verdict:
    """Longest candidate prefix that greedy decoding would reproduce.

    ``predicted[i]`` is the argmax at kept-logit row ``i``; row 0 is ``last``; ``candidate_row(c, k)`` is the
    row of candidate ``c``'s token ``k`` (0-based). Example with K=2, ``predicted[0] = 7``: candidate (7, 9)
    whose token 7 predicts 9 and token 9 predicts 4 gives tokens [7, 9, 4].
    """
    best, best_length, best_next = None, 0, predicted[0]
    for index, candidate in enumerate(candidates):
        length, expected = 0, predicted[0]
        while length < len(candidate) and candidate[length] == expected:
            expected = predicted[candidate_row(index, length)]
            length += 1
        if length > best_length:
            best, best_length, best_next = index, length, expected
    accepted = list(candidates[best][:best_length]) if best is not None else []
    return Verdict(best, best_length, [*accepted, best_next])


def verify_sampling(
    probs: torch.Tensor,
    candidates: Sequence[Sequence[int]],
    candidate_row: Callable[[int, int], int],
    generator: torch.Generator | None,
) -> Verdict:
    """Distribution-preserving multi-candidate verification.

    ``probs`` holds warped probabilities per kept-logit row (row 0 = ``last``), on the CPU. Candidates may
    differ in length (a token tree's paths); candidates that agree on a prefix must read the same rows for it.
    """
    survivors = list(range(len(candidates)))
    target = probs[0].clone()
    accepted: list[int] = []
    winner = None
    depth = max((len(candidate) for candidate in candidates), default=0)
    for k in range(depth):
        survivors = [c for c in survivors if len(candidates[c]) > k]
        if not survivors:
            break
        chosen = _accept_one(target, [candidates[c][k] for c in survivors], generator)
        if chosen is None:
            break
        accepted.append(chosen)
        survivors = [c for c in survivors if candidates[c][k] == chosen]
        winner = survivors[0]
        target = probs[candidate_row(winner, k)].clone()
    return Verdict(winner, len(accepted), [*accepted, sample(target, generator)])


def verify_constrained(
    scores: torch.Tensor,
    candidates: Sequence[Sequence[int]],
    candidate_row: Callable[[int, int], int],
    constraint: Constraint,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """``verify_greedy`` (argmax) or ``verify_sampling`` (its acceptance rule) over ``scores`` ``[rows, vocab]``
    with each row masked by ``constraint`` after the tokens accepted before it.

    ``constraint`` is left where it was found. Each candidate must be allowed by it whole (the engine cuts
    guesses at the first forbidden token), so the walk only moves through allowed states. A guess of the
    grammar's end (``constraint.eos``) that is taken ends the run as its model token.
    """
    survivors = list(range(len(candidates)))
    accepted: list[int] = []
    winner, row = None, 0
    try:
        while True:
            depth = len(accepted)
            target = constraint.mask(scores[row])
            survivors = [c for c in survivors if len(candidates[c]) > depth]
            proposals = [candidates[c][depth] for c in survivors]
            if sampling.greedy:
                token = int(target.argmax())
                chosen = token if token in proposals else None
            else:
                probs = warp(target.unsqueeze(0), sampling)[0].cpu()
                chosen = _accept_one(probs, proposals, generator)
                token = chosen if chosen is not None else sample(probs, generator)
            if chosen is None or chosen == constraint.eos:  # nothing follows the end of the grammar's output
                return Verdict(winner, depth, [*accepted, token])
            accepted.append(chosen)
            survivors = [c for c in survivors if candidates[c][depth] == chosen]
            winner = survivors[0]
            constraint.advance(chosen)
            row = candidate_row(winner, depth)
    finally:
        constraint.retreat(len(accepted))


def _accept_one(target: torch.Tensor, proposals: Sequence[int], generator: torch.Generator | None) -> int | None:
    """Try each distinct proposal in order; accept x with probability ``target[x]``, else zero it out.

    Mutates ``target`` into the residual distribution when proposals are rejected.
    """
    tried: set[int] = set()
    for token in proposals:
        if token in tried:
            continue
        tried.add(token)
        mass = float(target[token])
        if mass > 0.0 and float(torch.rand((), generator=generator)) < mass:
            return token
        target[token] = 0.0
        total = float(target.sum())
        if total <= 0.0:
            break
        target /= total
    return None
