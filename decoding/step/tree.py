"""The verification branch as a token tree: candidates that start alike share their common prefix.

Contract: ``TokenTree.build(candidates)`` merges candidates (token tuples of any lengths >= 1, all guessing the
tokens after ``last``) into a trie. Each distinct prefix becomes one node, so one step verifies G candidates
with fewer than G x K input tokens when they share prefixes (SpecInfer, Medusa). Nodes are numbered in order
of first appearance, so a parent always comes before its children; ``parents[i]`` is node i's parent (-1: a
child of ``last``), ``depths[i]`` its depth (1 = the token right after ``last``), ``owners[i]`` the first
candidate through it, ``index`` maps each node's prefix (the tokens from ``last`` down to it) to the node, and
``paths[c][k]`` (``path(c)[k]``) is the node holding candidate c's token k. Verification reads candidate c's
token k at that node's logit row (``decoding.step.verify.verify_tree`` walks the tree itself).

A step grows its tree as its drafts are gathered (``TreeBuilder``: the same trie, one candidate at a time, whose
``index`` also answers whether a draft is a prefix of one kept before; one builder for both of a step's gathers) and
keeps a tree's first candidates (``first``) without walking their tokens again.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

Draft = tuple[int, ...]


@dataclass(frozen=True)
class TokenTree:
    """Candidates merged into a trie (module contract).

    >>> tree = TokenTree.build([(5, 6, 7), (5, 6, 8), (9,)])
    >>> tree.tokens, tree.parents, tree.depths
    ((5, 6, 7, 8, 9), (-1, 0, 1, 1, -1), (1, 2, 3, 3, 1))
    >>> tree.paths
    ((0, 1, 2), (0, 1, 3), (4,))
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    candidates: tuple[Draft, ...] = ()
    owners: tuple[int, ...] = ()
    index: dict[Draft, int] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, candidates: Sequence[Sequence[int]]) -> TokenTree:
        """Merge ``candidates`` into a trie; a candidate that repeats another's prefix adds no node."""
        builder = TreeBuilder()
        for candidate in candidates:
            builder.add(tuple(candidate))
        return builder.tree()

    def __len__(self) -> int:
        """Nodes, i.e. input tokens of the verification branch."""
        return len(self.tokens)

    def path(self, candidate: int) -> tuple[int, ...]:
        """The nodes holding candidate ``candidate``'s tokens, in order (found once, on first use)."""
        path = self._paths_found.get(candidate)
        if path is None:
            tokens = self.candidates[candidate]
            path = self._paths_found[candidate] = tuple(self.index[tokens[:end]] for end in range(1, len(tokens) + 1))
        return path

    @functools.cached_property
    def _paths_found(self) -> dict[int, tuple[int, ...]]:
        return {}

    @functools.cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Every candidate's ``path``."""
        return tuple(self.path(candidate) for candidate in range(len(self.candidates)))

    def node_paths(self) -> list[tuple[int, ...]]:
        """Each node's tokens from the root down to it (its own included).

        >>> TokenTree.build([(5, 6, 7), (5, 8)]).node_paths()
        [(5,), (5, 6), (5, 6, 7), (5, 8)]
        """
        return list(self.index)

    def prefix_sizes(self) -> list[int]:
        """``sizes[k]``: the nodes of the tree of the first k+1 candidates. Nodes are numbered in order of first
        appearance, so that tree is this one's first ``sizes[k]`` nodes; the sizes never fall (a candidate's last
        node is its path's highest).

        >>> TokenTree.build([(5, 6, 7), (5, 6, 8), (5, 6), (9,)]).prefix_sizes()
        [3, 4, 4, 5]
        """
        sizes, size = [], 0
        for candidate in self.candidates:
            size = max(size, self.index.get(candidate, -1) + 1)
            sizes.append(size)
        return sizes

    def first(self, count: int) -> TokenTree:
        """The tree of the first ``count`` candidates: this one's first ``prefix_sizes()[count - 1]`` nodes.

        >>> TokenTree.build([(5, 6, 7), (9,), (5, 8)]).first(2) == TokenTree.build([(5, 6, 7), (9,)])
        True
        """
        if count >= len(self.candidates):
            return self
        size = self.prefix_sizes()[count - 1] if count > 0 else 0
        return TokenTree(self.tokens[:size], self.parents[:size], self.depths[:size], self.candidates[:count],
                         self.owners[:size], {prefix: node for prefix, node in self.index.items() if node < size})

    @property
    def depth(self) -> int:
        """The longest candidate's length (0 when empty): the most guesses one step can accept."""
        return max(self.depths, default=0)


class TreeBuilder:
    """A ``TokenTree`` grown one candidate at a time; ``draft in builder`` says whether ``draft`` is a prefix of (or
    equal to) a candidate added before, ``len(builder)`` is the nodes so far.

    >>> builder = TreeBuilder()
    >>> builder.add((5, 6, 7)); builder.add((5, 8))
    >>> (5, 6) in builder, (6,) in builder, len(builder)
    (True, False, 4)
    """

    def __init__(self) -> None:
        self.index: dict[Draft, int] = {}
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.owners: list[int] = []
        self.candidates: list[Draft] = []

    def __contains__(self, draft: object) -> bool:
        return draft in self.index

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, candidate: Draft) -> None:
        """Add ``candidate`` (a tuple): its prefixes not yet nodes become nodes. The prefixes held are closed under
        taking prefixes, so the walk looks up prefixes until the first one missing and adds every longer one (or,
        when all but the last token is there, adds the last)."""
        owner = len(self.candidates)
        self.candidates.append(candidate)
        index, known, parent = self.index, 0, -1
        if candidate in index:
            return
        size = len(candidate)
        if size > 1:  # most often all but its last token is there (a tree's leaves, a longer copy)
            node = index.get(candidate[:-1])
            if node is not None:
                parent, known = node, size - 1
        while known < size - 1:  # the whole candidate is not there (checked above)
            node = index.get(candidate[: known + 1])
            if node is None:
                break
            parent, known = node, known + 1
        for end in range(known + 1, size + 1):
            node = index[candidate if end == size else candidate[:end]] = len(self.tokens)
            self.tokens.append(candidate[end - 1])
            self.parents.append(parent)
            self.depths.append(end)
            self.owners.append(owner)
            parent = node

    def tree(self) -> TokenTree:
        """The tree of the candidates added so far."""
        return TokenTree(tuple(self.tokens), tuple(self.parents), tuple(self.depths), tuple(self.candidates),
                         tuple(self.owners), self.index)
