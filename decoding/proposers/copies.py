"""Copies of the decode's own context (``copy``): prompt lookup's long drafts inside lookahead decoding.

Contract: ``CopyProposer`` proposes, when the ``copy_min_match`` tokens before ``last`` also precede an earlier
occurrence of ``last`` in the indexed prompt and output (``Context.index``), the continuations of up to
``copy_candidates`` such occurrences (``ContextIndex.best_copies``' order): the best one ``span.length`` tokens
long (``copy_length``, doubled after whole copies up to ``copy_stretch`` times it: ``Span``), the others
``copy_length``. Standalone: a lazy-window step verifies them alone. Gated by its own running mean of accepted
tokens against ``break_even``. Built only with ``copy_length`` > 0 and ``rank_by_context``.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, GatedCopies, Span, stretched

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
        """The best-matching earlier contexts' continuations, while copying pays."""
        config = self.config
        found = context.index.best_copies(context.tokens, self.span.length, config.copy_min_match,
                                          min(budget, config.copy_candidates))
        return self.gated(context, stretched(found, config.copy_length))
