"""The Jacobi window and its n-gram pool: lookahead decoding's own candidate source (``pool``).

Contract: ``JacobiProposer`` owns the 2-D Jacobi window (``decoding.proposers.window.Window``), the n-gram pool it fills
(``decoding.proposers.pool.NGramPool``) and the gate of verifying steps. ``propose`` returns up to ``budget`` n-grams
(N-1 tokens) after ``last``: with ``rank_by_context``, the prompt's and output's continuations best matching the
preceding context first (``Context.index``), then the pool's, most recent first; none while its gate says verifying does
not pay at their price, the window's tokens included where the window is lazy (it then runs for them alone;
``decoding.proposers.base.break_even``). ``wants_window`` says whether the step should run the window even without a
candidate (it pays and the window is not lazy). The step reads ``window`` for its lookahead branch and reports back
through ``advance`` (the window ran: its new bottom row) or ``skip`` (it did not), then ``feedback``, which folds the
step's accepted guesses into the gate and, without ``rank_by_context``, adds the new output's n-grams to the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, Gate, Outcome, break_even, tree_size
from decoding.proposers.pool import NGramPool
from decoding.proposers.window import Window, context_filler

POOL = "pool"


class JacobiProposer:
    """The window, the pool and the verifying gate of one decode (module contract)."""

    name = POOL
    standalone = False
    in_guess_set = True
    top_k = 0

    def __init__(self, config: LookaheadConfig, context: Context) -> None:
        self.config = config
        filler = context_filler(context.tokens, exclude=context.stop_token_ids)
        self.window = Window(config.window_size, config.levels, filler)
        self.pool = NGramPool(config.levels, config.guess_set_size)
        self.scanned = 0
        if config.prompt_pool and not config.rank_by_context:
            self.scanned = self.pool.add_sequence(context.tokens[: context.prompt_length])
        self.scanned = max(self.scanned, context.prompt_length - config.levels)
        self.gate = Gate(float(config.levels))
        self.paying = False

    @property
    def expected(self) -> float:
        return self.gate.expected

    @property
    def wants_window(self) -> bool:
        """Run the window this step even with no candidate: verifying pays and the window is not lazy."""
        return self.paying and not self.config.lazy_window

    @property
    def window_tokens(self) -> int:
        """Input tokens of the window's branch (its rows x W)."""
        return self.window.depth * self.config.window_size

    def propose(self, context: Context, budget: int) -> Sequence[Draft]:
        """Up to ``budget`` n-grams: ranked context continuations, then the pool's (module contract)."""
        config = self.config
        if self.gate.expected < config.break_even:  # no price pays below break-even: only a probe verifies
            self.paying = self.gate.pays_when(False)
            return self._found(context, budget) if self.paying and budget > 0 else ()
        found = self._found(context, budget) if budget > 0 else []
        window = self.window_tokens if config.lazy_window else 0  # a lazy window runs for these drafts alone
        self.paying = self.gate.pays(break_even(config, context, window + tree_size(found)))
        return found if self.paying else ()

    def _found(self, context: Context, budget: int) -> list[Draft]:
        """Up to ``budget`` n-grams after ``last``: ranked context continuations, then the pool's."""
        config = self.config
        found = context.index.candidates(context.tokens, config.levels, budget) if config.rank_by_context else []
        for candidate in self.pool.candidates(context.last, budget):
            if len(found) == budget:
                break
            if candidate not in found:
                found.append(candidate)
        return found

    def advance(self, last: int, new_row: Sequence[int], committed: int) -> None:
        """The window ran: store its column n-grams in the pool, then move it on by ``committed`` tokens."""
        self.pool.add_chains(self.window.ngrams(last, new_row))
        self.window.advance(new_row, committed, self.config.align_window)

    def skip(self, committed: int) -> None:
        """The window did not run: re-align it after ``committed`` tokens."""
        self.window.skip(committed, self.config.align_window)

    def feedback(self, context: Context, outcome: Outcome) -> None:
        """Fold the accepted guesses into the gate; without ranked context, store the output's new n-grams."""
        if outcome.reach is not None:
            self.gate.update(outcome.reach)
        if self.config.output_pool and not self.config.rank_by_context:
            self.scanned = self.pool.add_sequence(context.tokens, self.scanned)
