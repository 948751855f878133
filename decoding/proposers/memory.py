"""The server-wide n-gram memory as a candidate source (``memory``).

Contract: ``MemoryProposer`` proposes continuations of ``last`` from the shared
``decoding.proposers.ngram_memory.NGramMemory`` (recent completions of every request), matched on at least
``copy_min_match`` preceding tokens. With copy steps on (``copy_length`` > 0) it is standalone and proposes like the
context's copies: up to ``copy_candidates``, cut to the length that pays (``GatedCopies.sized``, its own estimate),
its best one stretched (``Span``), the others at most ``copy_length`` tokens; without, it proposes (N-1)-token
n-grams that join the window's step, gated by its own running mean of accepted tokens.
Built only when the decode has a memory (``DecodeStream``'s ``memory``, not opted out by
``LookaheadConfig.shared_memory``). It only reads the memory: the stream adds its output when it finishes.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, GatedCopies, Span
from decoding.proposers.ngram_memory import NGramMemory

MEMORY = "memory"


class MemoryProposer(GatedCopies):
    """Continuations from the shared memory (module contract)."""

    name = MEMORY
    top_k = 0
    in_guess_set = True

    def __init__(self, config: LookaheadConfig, memory: NGramMemory) -> None:
        self.standalone = bool(config.copy_length)
        super().__init__(float(config.copy_length if self.standalone else config.levels),
                         Span(config.copy_length, config.copy_stretch * config.copy_length))
        self.config = config
        self.memory = memory

    def propose(self, context: Context, budget: int) -> Sequence[Draft]:
        """The memory's continuations of ``last`` (copies, or n-grams without copy steps), while they pay."""
        config = self.config
        if self.standalone:
            found = self.memory.candidates(context.tokens, self.span.length, min(budget, config.copy_candidates),
                                           config.copy_min_match)
            return self.sized(context, found, self.span.length)
        found = self.memory.candidates(context.tokens, config.levels, budget, config.copy_min_match)
        return self.gated(context, found)
