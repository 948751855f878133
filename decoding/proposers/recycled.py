"""Recycled logits (``recycled``): the top next tokens of every row a step reads, kept per token and offered as a
tree (Token Recycling, ACL 2025).

Contract: ``RecycledProposer`` keeps, per token id, the top ``LookaheadConfig.recycled`` tokens the model ranked
after it the last time a step read a logits row whose input was that token (``Outcome.successors``: ``last``'s row,
the window's bottom row, every tree node), so the table holds at most one entry per vocabulary token (``recycled``
ints each). The table is the decode's own, or one an engine shares among its decodes (``Inputs.successors``: then
one request's rows warm the next one's guesses, as the shared memory does; guesses only, never text). ``propose``
grows a tree from ``last`` through the table and offers its root-to-leaf paths, at most ``budget`` of them, in one
of two shapes (``LookaheadConfig.recycled_tree``): 0, the fixed one, ``recycled`` children at depth 1, ``BRANCH`` at
depth 2, one below, down to N-1 tokens, best ranks first; n > 0, best first: a node's score is the product, down its
path, of the measured chance that a successor of that rank is the next token given that its parent was
(``RankOdds``, learned from every step's outcome, starting from ``PRIOR``), and the n best-scoring nodes, at most
``TREE_DEPTH`` deep, make the tree, its leaves offered in the order they were taken. It joins the window's step,
gated by its own running mean against the tree's price (``decoding.proposers.base.break_even``). Its drafts are
guesses like any other: greedy output does not change.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, Gate, Outcome, break_even, tree_size

RECYCLED = "recycled"
BRANCH = 2  # the fixed shape's children per node at depth 2 (depth 1 takes all ``recycled``, deeper nodes one)
TREE_DEPTH = 8  # a best-first tree's deepest node, in tokens after ``last``
PRIOR = (0.5, 0.15, 0.08, 0.05, 0.04, 0.03, 0.025, 0.02)  # starting odds of a rank (then 0.01 each), PRIOR_WEIGHT steps
PRIOR_WEIGHT = 8.0


class RankOdds:
    """The measured chance that the successor of rank r of a token the text took is the text's next token.

    >>> odds = RankOdds(2)
    >>> odds.seen(0, True); odds.seen(1, False)
    >>> round(odds[0], 3), round(odds[1], 3)
    (0.556, 0.133)
    """

    def __init__(self, ranks: int) -> None:
        prior = [PRIOR[rank] if rank < len(PRIOR) else 0.01 for rank in range(ranks)]
        self.hits = [PRIOR_WEIGHT * value for value in prior]
        self.tries = [PRIOR_WEIGHT] * ranks

    def __getitem__(self, rank: int) -> float:
        return self.hits[rank] / self.tries[rank]

    def seen(self, rank: int, hit: bool) -> None:
        """Count one offered successor of ``rank`` whose parent the text took: ``hit`` if the text took it too."""
        self.tries[rank] += 1.0
        self.hits[rank] += float(hit)


class RecycledProposer:
    """A table of each token's top successors, offered as a tree (module contract)."""

    name = RECYCLED
    standalone = False

    def __init__(self, config: LookaheadConfig, table: dict[int, tuple[int, ...]] | None = None) -> None:
        self.config = config
        self.top_k = config.recycled
        self.in_guess_set = not config.recycled_tree  # a best-first tree is bounded by its own size
        self.gate = Gate(1.0)
        self.table: dict[int, tuple[int, ...]] = {} if table is None else table  # shared: the engine's
        self.odds = RankOdds(self.top_k)
        self.offered: dict[Draft, int] = {}  # this step's tree: each node's path and its rank among its siblings

    @property
    def expected(self) -> float:
        return self.gate.expected

    def propose(self, context: Context, budget: int) -> Sequence[Draft]:
        """The tree's root-to-leaf paths from ``last``, at most ``budget`` (module contract).

        >>> table = {1: (2, 3), 2: (4, 5), 3: (6,), 4: (7,), 5: (8,)}
        >>> source = RecycledProposer(LookaheadConfig(ngram_size=4, recycled=2), table)
        >>> source.propose(Context([0, 1], 1, None, frozenset()), budget=8)
        [(2, 4, 7), (2, 5, 8), (3, 6)]
        >>> source = RecycledProposer(LookaheadConfig(ngram_size=4, recycled=2, recycled_tree=6), table)
        >>> source.propose(Context([0, 1], 1, None, frozenset()), budget=8)
        [(2, 4, 7), (2, 5), (3, 6)]
        """
        self.offered = {}
        if budget <= 0 or context.last not in self.table:
            return ()
        drafts: list[Draft] = []
        if self.config.recycled_tree:
            self.offered = self._best_first(context.last, self.config.recycled_tree)
            parents = {path[:-1] for path in self.offered}
            drafts = [path for path in self.offered if path not in parents][:budget]
        else:
            self._grow((), context.last, drafts, budget)
        if not self.gate.pays(break_even(self.config, context, tree_size(drafts))):
            self.offered = {}
            return ()
        return drafts

    def _grow(self, path: Draft, token: int, drafts: list[Draft], budget: int) -> None:
        """The fixed shape: append the leaves under ``path`` (whose last token is ``token``) to ``drafts``, depth
        first."""
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

    def _best_first(self, last: int, nodes: int) -> dict[Draft, int]:
        """The best ``nodes`` nodes under ``last``, in the order taken (best first): each one's path and rank."""
        heap: list[tuple[float, int, Draft, int]] = []
        order = 0

        def push(path: Draft, score: float, token: int) -> None:
            nonlocal order
            if len(path) >= TREE_DEPTH:
                return
            for rank, child in enumerate(self.table.get(token, ())[: self.top_k]):
                heapq.heappush(heap, (-score * self.odds[rank], order, (*path, child), rank))
                order += 1

        push((), 1.0, last)
        taken: dict[Draft, int] = {}
        while heap and len(taken) < nodes:
            negative, _, path, rank = heapq.heappop(heap)
            taken[path] = rank
            push(path, -negative, path[-1])
        return taken

    def feedback(self, context: Context, outcome: Outcome) -> None:
        """Store each read row's top successors under its input token; learn the ranks' odds from a best-first
        tree's nodes whose parent was accepted (when the tree was verified); fold the reach into the gate."""
        if self.offered and outcome.reach is not None:
            accepted = outcome.accepted
            for path, rank in self.offered.items():
                depth = len(path) - 1
                if depth <= len(accepted) and path[:-1] == accepted[:depth]:
                    self.odds.seen(rank, depth < len(accepted) and accepted[depth] == path[-1])
        self.offered = {}
        for token, successors in outcome.successors:
            self.table[token] = successors
        if outcome.reach is not None:
            self.gate.update(outcome.reach)
