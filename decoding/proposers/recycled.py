"""Recycled logits (``recycled``): the top next tokens of every row a step reads, kept per token and offered as a
tree (Token Recycling, ACL 2025).

Contract: ``RecycledProposer`` keeps, per token id, the top ``LookaheadConfig.recycled`` tokens the model ranked
after it the last time a step read a logits row whose input was that token (``Outcome.successors``: ``last``'s row,
the window's bottom row, every tree node), so the table holds at most one entry per vocabulary token (``recycled``
ints each). The table is the decode's own, or one an engine shares among its decodes (``Inputs.successors``: then
one request's rows warm the next one's guesses, as the shared memory does; guesses only, never text). ``propose``
grows a tree from ``last`` through the table: ``recycled`` children at depth 1, ``BRANCH`` at depth 2, one below,
down to N-1 tokens, and offers its root-to-leaf paths, best ranks first, at most ``budget`` of them. It joins the
window's step, gated by its own running mean. Its drafts are guesses like any other: greedy output does not change.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, Gate, Outcome

RECYCLED = "recycled"
BRANCH = 2  # children per node at depth 2 (depth 1 takes all ``recycled``, deeper nodes one)


class RecycledProposer:
    """A table of each token's top successors, offered as a tree (module contract)."""

    name = RECYCLED
    standalone = False

    def __init__(self, config: LookaheadConfig, table: dict[int, tuple[int, ...]] | None = None) -> None:
        self.config = config
        self.top_k = config.recycled
        self.gate = Gate(1.0)
        self.table: dict[int, tuple[int, ...]] = {} if table is None else table  # shared: the engine's

    @property
    def expected(self) -> float:
        return self.gate.expected

    def propose(self, context: Context, budget: int) -> Sequence[Draft]:
        """The tree's root-to-leaf paths from ``last``, best ranks first, at most ``budget``.

        >>> source = RecycledProposer(LookaheadConfig(ngram_size=4, recycled=2))
        >>> source.table = {1: (2, 3), 2: (4, 5), 3: (6,), 4: (7,), 5: (8,)}
        >>> source.propose(Context([0, 1], 1, None, frozenset()), budget=8)
        [(2, 4, 7), (2, 5, 8), (3, 6)]
        """
        if budget <= 0 or context.last not in self.table:
            return ()
        drafts: list[Draft] = []
        self._grow((), context.last, drafts, budget)
        if not self.gate.pays(self.config.break_even):
            return ()
        return drafts

    def _grow(self, path: Draft, token: int, drafts: list[Draft], budget: int) -> None:
        """Append the leaves under ``path`` (whose last token is ``token``) to ``drafts``, depth first."""
        depth = len(path)
        width = self.top_k if depth == 0 else BRANCH if depth == 1 else 1
        children = self.table.get(token, ())[:width] if depth < self.config.levels else ()
        if not children:
            if path:
                drafts.append(path)
            return
        for child in children:
            if len(drafts) >= budget:
                return
            self._grow((*path, child), child, drafts, budget)

    def feedback(self, context: Context, outcome: Outcome) -> None:
        """Store each read row's top successors under its input token; fold the reach into the gate."""
        for token, successors in outcome.successors:
            self.table[token] = successors
        if outcome.reach is not None:
            self.gate.update(outcome.reach)
