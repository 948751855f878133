"""Grammar jump-forward (``jump``): the tokens a request's grammar forces next, offered as a guess.

Contract: ``JumpProposer`` proposes, for a decode with a grammar (``decoding.grammar.Constraint``), the run of up to
``JUMP_LENGTH`` tokens the grammar forces after ``last`` (``Constraint.forced``: a JSON key, a tool name, closing
brackets), as one standalone draft. The model still verifies it: a forced run the model would tokenize otherwise
is cut where it differs, so constrained output stays the constrained loop's. Gated by its own running mean.
Built only for decodes with a grammar and ``LookaheadConfig.jump_forward`` on.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.grammar import Constraint
from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, Gate, Outcome, break_even

JUMP = "jump"
JUMP_LENGTH = 32  # the most forced tokens one draft holds


class JumpProposer:
    """The grammar's forced tokens (module contract)."""

    name = JUMP
    standalone = True
    in_guess_set = True
    top_k = 0

    def __init__(self, config: LookaheadConfig, constraint: Constraint) -> None:
        self.config = config
        self.constraint = constraint
        self.gate = Gate(1.0)

    @property
    def expected(self) -> float:
        return self.gate.expected

    def propose(self, context: Context, budget: int) -> Sequence[Draft]:
        """The forced run after ``last``, when there is one and it pays."""
        forced = tuple(self.constraint.forced(JUMP_LENGTH)) if budget > 0 else ()
        if not forced or not self.gate.pays(break_even(self.config, context, len(forced))):
            return ()
        return [forced]

    def feedback(self, context: Context, outcome: Outcome) -> None:
        """Fold how far the forced run reached into the gate."""
        if outcome.reach is not None:
            self.gate.update(outcome.reach)
