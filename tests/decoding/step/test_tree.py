"""The token tree cut as the step uses it equals the tree built from its candidates at once, and
one walk down it gives the verdict of walking every candidate."""

from __future__ import annotations

import random

import pytest

from decoding.step.tree import TokenTree, TreeBuilder
from decoding.step.verify import verify_greedy, verify_tree


def _candidates(rng: random.Random, vocab: int) -> list[tuple[int, ...]]:
    """Random candidates over a small vocabulary, so that many share prefixes (and some repeat)."""
    return [tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 12))]


def _same(tree: TokenTree, expected: TokenTree) -> None:
    assert (tree.tokens, tree.parents, tree.depths, tree.owners, tree.candidates) == (
        expected.tokens, expected.parents, expected.depths, expected.owners, expected.candidates)
    assert tree.paths == expected.paths and list(tree.index.items()) == list(expected.index.items())


def _naive(candidates: list[tuple[int, ...]]) -> tuple[tuple, tuple, tuple]:
    """The trie's tokens, parents and depths, every prefix of every candidate walked in order."""
    nodes: dict[tuple[int, ...], int] = {}
    tokens, parents, depths = [], [], []
    for candidate in candidates:
        for end in range(1, len(candidate) + 1):
            if candidate[:end] not in nodes:
                nodes[candidate[:end]] = len(tokens)
                tokens.append(candidate[end - 1])
                parents.append(nodes[candidate[: end - 1]] if end > 1 else -1)
                depths.append(end)
    return tuple(tokens), tuple(parents), tuple(depths)


@pytest.mark.parametrize("seed", range(5))
def test_first_trees_are_the_trees_of_their_candidates(seed):
    rng = random.Random(seed)
    for _ in range(200):
        first, second = _candidates(rng, 3), _candidates(rng, 3)
        whole = TokenTree.build(first + second)
        assert (whole.tokens, whole.parents, whole.depths) == _naive(first + second)
        count = rng.randint(0, len(first) + len(second))
        _same(whole.first(count), TokenTree.build((first + second)[:count]))
        builder = TreeBuilder()
        for candidate in first:
            builder.add(candidate)
        assert all((prefix in builder) == any(candidate[: len(prefix)] == prefix for candidate in first)
                   for prefix in {candidate[:end] for candidate in first + second for end in range(1, 4)})
        assert all(whole.owners[node] == min(c for c, path in enumerate(whole.paths) if node in path)
                   for node in range(len(whole)))


@pytest.mark.parametrize("seed", range(5))
def test_one_walk_down_the_tree_gives_the_verdict_of_every_candidate_walked(seed):
    rng = random.Random(seed)
    for _ in range(300):
        tree = TokenTree.build(_candidates(rng, 3))
        predicted = [rng.randrange(3) for _ in range(1 + len(tree))]
        paths = tree.paths
        walked = verify_greedy(predicted, tree.candidates, lambda c, k, paths=paths: 1 + paths[c][k])
        assert verify_tree(predicted, tree, lambda node: 1 + node) == walked
