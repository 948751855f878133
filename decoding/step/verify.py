"""Candidate verification: which guesses the step's chosen tokens confirm.

Contract: both verifiers take the step's candidates (lists of guessed tokens, of any lengths) and return a
``Verdict``: which candidate won, how many of its tokens were accepted (``m``), and the committed run (those
``m`` tokens plus the token chosen at the last accepted position: 1..K+1 tokens, K the longest candidate's
length). The run equals what the plain loop would commit: each position's token is chosen by a rule that depends
on that position only (the argmax, or the seeded sample of ``decoding.step.sampling``), so a guess is accepted
exactly when it is the token that would have been chosen there.

- ``verify_greedy`` walks the candidates over the chosen token of each row (argmax ids, or ``SampledRows``).
- ``verify_tree`` gives ``verify_greedy``'s verdict on a token tree's candidates in one walk down the tree: every
  candidate through a node reads the same row there, so the candidates' walks are one walk along the chosen tokens,
  and the winner is the first candidate through the deepest node it reaches.
- ``verify_constrained`` does the same under a grammar's masks: it walks the candidates position by position,
  masking each row after the tokens accepted before it, so each mask is computed once per accepted token (plus
  one), never for rows that are not reached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from decoding.grammar import Constraint
from decoding.step.tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    """Outcome of verification: ``tokens`` = the accepted candidate prefix + one model token."""

    candidate: int | None
    num_accepted: int
    tokens: list[int]


class ChosenRows(Protocol):
    """The token chosen at each logits row (a list of argmax ids, or ``decoding.step.sampling.SampledRows``)."""

    def __getitem__(self, row: int) -> int: ...


def verify_greedy(
    predicted: ChosenRows, candidates: Sequence[Sequence[int]], candidate_row: Callable[[int, int], int]
) -> Verdict:
    """Longest candidate prefix that the plain loop would reproduce.

    ``predicted[i]`` is the token chosen at kept-logit row ``i``; row 0 is ``last``; ``candidate_row(c, k)`` is
    the row of candidate ``c``'s token ``k`` (0-based). Only the rows the walk reaches are read. Example with
    K=2, ``predicted[0] = 7``: candidate (7, 9) whose token 7 predicts 9 and token 9 predicts 4 gives tokens
    [7, 9, 4].
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


def verify_tree(predicted: ChosenRows, tree: TokenTree, node_row: Callable[[int], int]) -> Verdict:
    """``verify_greedy(predicted, tree.candidates, lambda c, k: node_row(tree.path(c)[k]))`` in one walk: from
    ``last`` (row 0) down the child holding each row's chosen token, reading only the rows walked through.

    >>> tree = TokenTree.build([(7, 8), (7, 9, 4), (7, 9, 5)])  # nodes: 7, 8, 9, 4, 5
    >>> verify_tree([7, 9, 0, 5, 0, 0], tree, lambda node: 1 + node)  # 7 then 9 (row 1), then 5 (row 3): none
    Verdict(candidate=2, num_accepted=3, tokens=[7, 9, 5, 0])
    """
    accepted: list[int] = []
    expected, deepest = predicted[0], -1
    while True:
        node = tree.index.get((*accepted, expected))
        if node is None:
            break
        accepted.append(expected)
        deepest, expected = node, predicted[node_row(node)]
    if deepest < 0:
        return Verdict(None, 0, [expected])
    return Verdict(tree.owners[deepest], len(accepted), [*accepted, expected])


def verify_constrained(
    scores: torch.Tensor,
    candidates: Sequence[Sequence[int]],
    candidate_row: Callable[[int, int], int],
    constraint: Constraint,
    choose: Callable[[torch.Tensor, int], int],
) -> Verdict:
    """``verify_greedy`` over ``scores`` ``[rows, vocab]`` with each row masked by ``constraint`` after the tokens
    accepted before it; ``choose(masked_row, depth)`` picks the token of the row ``depth`` tokens past the step's
    first (``decoding.step.sampling.row_chooser``).

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
            token = choose(constraint.mask(scores[row]), depth)
            survivors = [c for c in survivors if len(candidates[c]) > depth and candidates[c][depth] == token]
            if not survivors or token == constraint.eos:  # nothing follows the end of the grammar's output
                return Verdict(winner, depth, [*accepted, token])
            accepted.append(token)
            winner = survivors[0]
            constraint.advance(token)
            row = candidate_row(winner, depth)
    finally:
        constraint.retreat(len(accepted))
