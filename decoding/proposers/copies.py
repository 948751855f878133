"""Copies of the decode's own context (``copy``): prompt lookup's long drafts inside lookahead decoding.

Contract: ``CopyProposer`` proposes, when the ``copy_min_match`` tokens before ``last`` also precede an earlier
occurrence of ``last`` in the indexed prompt and output (``Context.index``), the continuations of up to
``copy_candidates`` such occurrences (``ContextIndex.best_copies``' order), cut to the length that commits the most
tokens per unit of step cost by how far this decode's copies have been accepted (``decoding.proposers.survival``,
priced on ``Context.price``) and to at most ``span.length`` tokens (``copy_length``, doubled after whole copies up to
``copy_stretch`` times it: ``Span``), and to at least twice the last verified copy's length when that one was
accepted whole (the estimate learns nothing past a copy's end: a decode gone short tries longer copies where its
short ones hold); every copy but the best at most ``copy_length``. Standalone: a lazy-window step
verifies them alone. Gated: proposed while the accepted tokens they expect reach their price (``LookaheadConfig
.break_even`` where no step-cost curve prices them), else on the gate's probe schedule. Built only with
``copy_length`` > 0 and ``rank_by_context``.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, GatedCopies, Outcome, Span, free, stretched, tree_size
from decoding.proposers.survival import Survival

COPY = "copy"


class CopyProposer(GatedCopies):
    """Copied continuations of the context (module contract)."""

    name = COPY
    standalone = True
    in_guess_set = True
    top_k = 0

    def __init__(self, config: LookaheadConfig) -> None:
        super().__init__(float(config.copy_length), Span(config.copy_length, config.copy_stretch * config.copy_length))
        self.config = config
        self.survival = Survival()
        self._expected = float(config.copy_length)  # accepted tokens the last copies proposed expect
        self._offered = 0  # the tokens of the best copy last proposed
        self._grow = 1  # the least length of the next copies: twice the last verified one's, when it was accepted whole

    @property
    def expected(self) -> float:
        return self._expected

    def propose(self, context: Context, budget: int) -> Sequence[Draft]:
        """The best-matching earlier contexts' continuations at their best length, while copying pays."""
        config = self.config
        found = context.index.best_copies(context.tokens, self.span.length, config.copy_min_match,
                                          min(budget, config.copy_candidates))
        if not found:
            return ()
        length, expected = self.survival.best(context.price, self.span.length)
        if length < self._grow:
            length = min(self._grow, self.span.length)
            expected = self.survival.expected(length)
        drafts = stretched([copy[:length] for copy in found], min(length, config.copy_length))
        floor = config.break_even if context.price is free else context.price(tree_size(drafts))
        if not self.gate.pays_when(expected >= floor):
            return ()
        self._expected, self._offered = expected, len(drafts[0])
        return drafts

    def feedback(self, context: Context, outcome: Outcome) -> None:
        """Fold how far the verified copies reached into the survival estimate and the span."""
        if outcome.reach is not None:
            offered = max(self._offered, outcome.reach)
            self.survival.update(offered, outcome.reach)
            self.span.update(outcome.reach)
            self._grow = 2 * offered if outcome.reach >= offered else 1
