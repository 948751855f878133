"""Copies of the decode's own context (``copy``): prompt lookup's long drafts inside lookahead decoding.

Contract: ``CopyProposer`` proposes, when the ``copy_min_match`` tokens before ``last`` also precede an earlier
occurrence of ``last`` in the indexed prompt and output (``Context.index``), the continuations of up to
``copy_candidates`` such occurrences (``ContextIndex.best_copies``' order), cut to the length that commits the most
tokens per unit of step cost by how far this decode's copies have been accepted (``GatedCopies.sized``), at most
``span.length`` tokens (``copy_length``, doubled after whole copies up to ``copy_stretch`` times it: ``Span``); every
copy but the best at most ``copy_length``. Standalone: a lazy-window step verifies them alone. Gated: proposed while
the accepted tokens they expect reach their price (``LookaheadConfig.break_even`` where no step-cost curve prices
them), else on the gate's probe schedule. Built only with ``copy_length`` > 0 and ``rank_by_context``.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, GatedCopies, Span

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

    def propose(self, context: Context, budget: int) -> Sequence[Draft]:
        """The best-matching earlier contexts' continuations at the length that pays, while copying pays."""
        config = self.config
        found = context.index.best_copies(context.tokens, self.span.length, config.copy_min_match,
                                          min(budget, config.copy_candidates))
        return self.sized(context, found, self.span.length)
