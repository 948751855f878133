"""Runner-up first tokens (``runner_up``): the model's next-best tokens as the first tokens of guesses (LogitSpec).

Contract: ``RunnerUpProposer`` hears, after each step, the top ``LookaheadConfig.runner_up`` tokens of the logits
row that chose the new ``last`` (``Outcome.runners_up``): that row already looked one token past ``last``, and its
runners-up often hold the token after it. Each becomes the first token of one draft, continued by the indexed
context's best-matching continuation of it (``ContextIndex.candidates``, up to N-2 more tokens; the draft is that
one token where none matches). It joins the window's step, gated by its own running mean of accepted tokens. Its
drafts are guesses like any other: greedy output does not change.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, Gate, Outcome, break_even, tree_size

RUNNER_UP = "runner_up"


class RunnerUpProposer:
    """The last row's runners-up, continued from the context (module contract)."""

    name = RUNNER_UP
    standalone = False
    in_guess_set = True

    def __init__(self, config: LookaheadConfig) -> None:
        self.config = config
        self.top_k = config.runner_up
        self.gate = Gate(1.0)
        self.first: tuple[int, ...] = ()

    @property
    def expected(self) -> float:
        return self.gate.expected

    def propose(self, context: Context, budget: int) -> Sequence[Draft]:
        """Up to ``budget`` drafts, one per runner-up token, best first."""
        if not self.first or budget <= 0:
            return ()
        length = self.config.levels - 1
        extended = [*context.tokens, 0]  # the text as it would read with the guessed token after ``last``
        drafts = []
        for token in self.first[:budget]:
            extended[-1] = token
            found = context.index.candidates(extended, length, 1) if length > 0 else []
            drafts.append((token, *found[0]) if found else (token,))
        if not self.gate.pays(break_even(self.config, context, tree_size(drafts))):
            return ()
        return drafts

    def feedback(self, context: Context, outcome: Outcome) -> None:
        """Keep the new row's runners-up; fold how far its drafts reached into the gate."""
        self.first = outcome.runners_up
        if outcome.reach is not None:
            self.gate.update(outcome.reach)
