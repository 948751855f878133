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
``TREE_DEPTH`` deep, make the tree, its leaves offered in the order they were taken. A score depends on the ranks
down a path alone, so the tree's shape (``RankShape``: each node's rank and parent) is chosen as if every token had
all its successors, again each ``RESHAPE`` steps the odds learn from, and each step walks it through the table: a
node whose parent's token has no successor of its rank is left out, with its subtree. It joins the window's step,
gated by its own running mean against the tree's price (``decoding.proposers.base.break_even``). Its drafts are
guesses like any other: greedy output does not change.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, Gate, Outcome, break_even, tree_size

RECYCLED = "recycled"
BRANCH = 2  # the fixed shape's children per node at depth 2 (depth 1 takes all ``recycled``, deeper nodes one)
TREE_DEPTH = 8  # a best-first tree's deepest node, in tokens after ``last``
PRIOR = (0.5, 0.15, 0.08, 0.05, 0.04, 0.03, 0.025, 0.02)  # starting odds of a rank (then 0.01 each), PRIOR_WEIGHT steps
PRIOR_WEIGHT = 8.0
RESHAPE = 16  # a best-first tree's shape is chosen again after this many steps taught the odds


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
        self._tree: BestFirst | None = None  # this step's best-first tree, when it offered one
        self._shape: RankShape | None = None  # the best-first tree's shape, chosen on the odds ``_taught`` steps ago
        self._taught = 0

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
        self.offered, self._tree = {}, None
        if budget <= 0 or context.last not in self.table:
            return ()
        drafts: list[Draft] = []
        if self.config.recycled_tree:
            if self._shape is None or self._taught >= RESHAPE:
                self._shape = RankShape.best([self.odds[rank] for rank in range(self.top_k)], self.config.recycled_tree)
                self._taught = 0
            tree = self._shape.walk(self.table, context.last)
            if not tree.paths:
                return ()
            drafts = tree.leaves[:budget]
            size = len(tree.paths) if len(drafts) == len(tree.leaves) else tree_size(drafts)  # every node is a
            self.offered, self._tree = dict(zip(tree.paths, tree.ranks, strict=True)), tree  # prefix of a leaf
        else:
            self._grow((), context.last, drafts, budget)
            size = tree_size(drafts)
        if not self.gate.pays(break_even(self.config, context, size)):
            self.offered, self._tree = {}, None
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

    def feedback(self, context: Context, outcome: Outcome) -> None:
        """Store each read row's top successors under its input token; learn the ranks' odds from a best-first
        tree's nodes whose parent was accepted (when the tree was verified); fold the reach into the gate."""
        if self._tree is not None and outcome.reach is not None:
            self._learn(self._tree, outcome.accepted)
            self._taught += 1
        self.offered, self._tree = {}, None
        self.table.update(outcome.successors)
        if outcome.reach is not None:
            self.gate.update(outcome.reach)

    def _learn(self, tree: BestFirst, accepted: Sequence[int]) -> None:
        """Count every node whose parent (or ``last``) lies on the ``accepted`` path as one try of its rank, a hit
        when it lies on that path too: down the path from ``last``, each node's children (siblings hold distinct
        tokens, so at most one of them is on it)."""
        children, parent, depth = tree.children, -1, 0
        while parent in children:
            token = accepted[depth] if depth < len(accepted) else None
            parent, below = -2, children[parent]
            for node in below:
                hit = tree.paths[node][-1] == token
                self.odds.seen(tree.ranks[node], hit)
                if hit:
                    parent = node
            depth += 1


@dataclass(frozen=True)
class BestFirst:
    """A best-first tree: its nodes in the order taken, each one's ``paths`` (tokens after ``last``), ``ranks``
    (among its siblings) and ``parents`` (index of its parent node, -1: a child of ``last``); ``leaves``: the
    paths of the nodes none of whose children was taken, in that order; ``children``: each node's children (-1:
    ``last``'s), in order, nodes without children left out."""

    paths: list[Draft]
    ranks: list[int]
    parents: list[int]
    leaves: list[Draft]
    children: dict[int, list[int]]


@dataclass(frozen=True)
class RankShape:
    """A best-first tree's shape: its nodes in the order taken, each one's rank among its siblings and parent (index
    of its parent node, -1: a child of ``last``), as if every token had all its successors.

    >>> shape = RankShape.best([0.5, 0.2], nodes=4)
    >>> shape.ranks, shape.parents
    ((0, 0, 1, 0), (-1, 0, -1, 1))
    >>> shape.walk({1: (2, 3), 2: (4, 5), 3: (6,)}, 1).paths  # token 4 has no successor: node 3 is left out
    [(2,), (2, 4), (3,)]
    """

    ranks: tuple[int, ...]
    parents: tuple[int, ...]

    @classmethod
    def best(cls, odds: Sequence[float], nodes: int) -> RankShape:
        """The shape of ``best_first``'s tree of ``nodes`` nodes over a table where every token has ``len(odds)``
        successors."""
        tree = best_first(_Complete(len(odds)), 0, odds, nodes)
        return cls(tuple(tree.ranks), tuple(tree.parents))

    def walk(self, table: dict[int, Sequence[int]], last: int) -> BestFirst:
        """This shape's tree under ``last`` through ``table``: each node the successor of its rank of its parent's
        token (``last``'s for a child of ``last``); a node whose parent's token has no such successor, and its
        subtree, are left out (the kept nodes renumbered in order). About 3x faster than ``best_first``."""
        paths: list[Draft] = []
        ranks: list[int] = []
        parents: list[int] = []
        kept: list[int] = []  # the shape's node i is tree node kept[i], -1: left out
        children: dict[int, list[int]] = {}
        get = table.get
        for rank, parent in zip(self.ranks, self.parents, strict=True):
            if parent < 0:
                path, at = (), -1
            else:
                at = kept[parent]
                if at < 0:
                    kept.append(-1)
                    continue
                path = paths[at]
            successors = get(path[-1] if path else last, ())
            if rank >= len(successors):
                kept.append(-1)
                continue
            node = len(paths)
            kept.append(node)
            paths.append((*path, successors[rank]))
            ranks.append(rank)
            parents.append(at)
            siblings = children.get(at)
            if siblings is None:
                children[at] = [node]
            else:
                siblings.append(node)
        return BestFirst(paths, ranks, parents, [path for index, path in enumerate(paths) if index not in children],
                         children)


class _Complete:
    """A successor table where every token has ``top_k`` successors, each a token of its own (ints, never equal)."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def get(self, token: int, default: Sequence[int] = ()) -> Sequence[int]:
        return range(token * self.top_k + 1, (token + 1) * self.top_k + 1)


def best_first(table: dict[int, Sequence[int]] | _Complete, last: int, odds: Sequence[float], nodes: int) -> BestFirst:
    """The ``nodes`` best-scoring nodes under ``last``, at most ``TREE_DEPTH`` deep: a node's score is its parent's
    times ``odds[rank]`` (``last``'s is 1), its children the first ``len(odds)`` successors ``table`` holds for
    its token.

    Taken in the order of a heap of every child of every taken node, keyed (-score, order pushed), children pushed
    rank by rank when their parent is taken: but each taken node keeps only its best untaken child in the heap
    (its children ranked once: by score, then rank), keyed (-score, when its parent was taken, rank), the same
    order, so a node costs two heap operations, not ``len(odds)`` + 1.

    >>> tree = best_first({1: (2, 3), 2: (4, 5), 3: (6,)}, 1, [0.5, 0.2], nodes=4)
    >>> tree.paths, tree.ranks, tree.parents, tree.leaves
    ([(2,), (2, 4), (3,), (2, 5)], [0, 0, 1, 1], [-1, 0, -1, 0], [(2, 4), (3,), (2, 5)])
    """
    top_k, order = len(odds), _rank_order(odds)
    heap: list[tuple] = []
    paths: list[Draft] = []
    ranks: list[int] = []
    parents: list[int] = []
    push, pop = heapq.heappush, heapq.heappop
    index, path, score, token = -1, (), 1.0, last
    while True:
        # the node just taken (``last`` first) puts its best child in the heap
        successors = table.get(token, ())[:top_k] if len(path) < TREE_DEPTH else ()
        if successors:
            if order is None:
                ranked = sorted(range(len(successors)), key=lambda rank: (-score * odds[rank], rank))  # noqa: B023
            else:
                ranked = order if len(successors) == top_k else [rank for rank in order if rank < len(successors)]
            push(heap, (-score * odds[ranked[0]], index, 0, ranked, successors, path, score))
        if not heap or len(paths) >= nodes:
            break
        negative, parent, at, ranked, successors, parent_path, parent_score = pop(heap)
        if at + 1 < len(ranked):  # the parent's next best child takes its place
            push(heap, (-parent_score * odds[ranked[at + 1]], parent, at + 1, ranked, successors, parent_path,
                        parent_score))
        rank = ranked[at]
        token = successors[rank]
        path = (*parent_path, token)
        paths.append(path)
        ranks.append(rank)
        parents.append(parent)
        index, score = len(paths) - 1, -negative
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return BestFirst(paths, ranks, parents, [path for index, path in enumerate(paths) if index not in children],
                     children)


def _rank_order(odds: Sequence[float]) -> list[int] | None:
    """The ranks by odds, best first (then by rank): the order of any node's children by (score, rank), unless
    two ranks out of rank order have odds so close that their scores could round to a tie (then None: rank each
    node's children by their scores).

    >>> _rank_order([0.5, 0.1, 0.2]), _rank_order([0.1, 0.1]), _rank_order([0.1, 0.1 * (1 + 1e-12)])
    ([0, 2, 1], [0, 1], None)
    """
    order = sorted(range(len(odds)), key=lambda rank: (-odds[rank], rank))
    for better, worse in zip(order, order[1:], strict=False):
        if better > worse and odds[better] <= odds[worse] * (1.0 + 1e-9):
            return None
    return order
