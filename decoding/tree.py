"""The verification branch as a token tree: candidates that start alike share their common prefix.

Contract: ``TokenTree.build(candidates)`` merges candidates (token tuples of any lengths >= 1, all guessing the
tokens after ``last``) into a trie. Each distinct prefix becomes one node, so one step verifies G candidates
with fewer than G x K input tokens when they share prefixes (SpecInfer, Medusa). Nodes are numbered in order
of first appearance, so a parent always comes before its children; ``parents[i]`` is node i's parent (-1: a
child of ``last``), ``depths[i]`` its depth (1 = the token right after ``last``), and ``paths[c][k]`` the node
holding candidate c's token k. Verification reads candidate c's token k at that node's logit row, so the
verifiers keep working on the candidate lists they are given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, candidates: Sequence[Sequence[int]]) -> TokenTree:
        """Merge ``candidates`` into a trie; a candidate that repeats another's prefix adds no node."""
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        children: dict[tuple[int, int], int] = {}
        paths = []
        for candidate in candidates:
            node, path = -1, []
            for token in candidate:
                child = children.get((node, token))
                if child is None:
                    child = len(tokens)
                    children[(node, token)] = child
                    tokens.append(token)
                    parents.append(node)
                    depths.append(1 if node < 0 else depths[node] + 1)
                node = child
                path.append(node)
            paths.append(tuple(path))
        return cls(tuple(tokens), tuple(parents), tuple(depths), tuple(paths))

    def __len__(self) -> int:
        """Nodes, i.e. input tokens of the verification branch."""
        return len(self.tokens)

    def node_paths(self) -> list[tuple[int, ...]]:
        """Each node's tokens from the root down to it (its own included).

        >>> TokenTree.build([(5, 6, 7), (5, 8)]).node_paths()
        [(5,), (5, 6), (5, 6, 7), (5, 8)]
        """
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(self.tokens, self.parents, strict=True):
            paths.append((*(paths[parent] if parent >= 0 else ()), token))
        return paths

    def prefix_sizes(self) -> list[int]:
        """``sizes[k]``: the nodes of the tree of the first k+1 candidates. Nodes are numbered in order of first
        appearance, so that tree is this one's first ``sizes[k]`` nodes; the sizes never fall.

        >>> TokenTree.build([(5, 6, 7), (5, 6, 8), (5, 6), (9,)]).prefix_sizes()
        [3, 4, 4, 5]
        """
        sizes, size = [], 0
        for path in self.paths:
            size = max(size, max(path, default=-1) + 1)
            sizes.append(size)
        return sizes

    @property
    def depth(self) -> int:
        """The longest candidate's length (0 when empty): the most guesses one step can accept."""
        return max(self.depths, default=0)
