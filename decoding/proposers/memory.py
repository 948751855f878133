"""The server-wide n-gram memory as a candidate source (``memory``).

Contract: ``MemoryProposer`` proposes continuations of ``last`` from the shared ``decoding.memory.NGramMemory``
(recent completions of every request), matched on at least ``copy_min_match`` preceding tokens. With copy steps
on (``copy_length`` > 0) it is standalone and proposes like the context's copies: up to ``copy_candidates``, its
best one stretched (``Span``), the others ``copy_length`` tokens; without, it proposes (N-1)-token n-grams that
join the window's step. Gated by its own running mean of accepted tokens. Built only when the decode has a
memory (``DecodeStream``'s ``memory``, not opted out by ``LookaheadConfig.shared_memory``). It only reads the
memory: the stream adds its output when it finishes.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.memory import NGramMemory
from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, Gate, Outcome, Span, stretched

MEMORY = "memory"


class MemoryProposer:
    """Continuations from the shared memory (module contract)."""

    name = MEMORY
    top_k = 0

    def __init__(self, config: LookaheadConfig, memory: NGramMemory) -> None:
        self.config = config
        self.memory = memory
        self.standalone = bool(config.copy_length)
        self.gate = Gate(float(config.copy_length if self.standalone else config.levels))
        self.span = Span(config.copy_length, config.copy_stretch * config.copy_length)

    @property
    def expected(self) -> float:
        return self.gate.expected

    def propose(self, context: Context, budget: int) -> Sequence[Draft]:
        """The memory's continuations of ``last`` (copies, or n-grams without copy steps), while they pay."""
        config = self.config
        if self.standalone:
            found = self.memory.candidates(context.tokens, self.span.length, min(budget, config.copy_candidates),
                                           config.copy_min_match)
            drafts = stretched(found, config.copy_length)
        else:
            drafts = self.memory.candidates(context.tokens, config.levels, budget, config.copy_min_match)
        if drafts and not self.gate.pays(config.break_even):
            return ()
        return drafts

    def feedback(self, context: Context, outcome: Outcome) -> None:
        """Fold how far its drafts reached into the gate and the span."""
        if outcome.reach is not None:
            self.gate.update(outcome.reach)
            self.span.update(outcome.reach)
