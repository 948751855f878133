"""Step layout (hand-written masks and positions) and the window's update rules."""

from __future__ import annotations

import itertools

import torch

from decoding.proposers.window import Window, context_filler, step_layout, window_chains, window_logit_row
from decoding.step.tree import TokenTree


def _grid(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[char == "x" for char in row] for row in rows])


def _chains(count: int, length: int) -> tuple[int, ...]:
    """Tree parents of ``count`` candidates of ``length`` tokens that share no prefix."""
    return TokenTree.build([[100 * c + k for k in range(length)] for c in range(count)]).parents


def test_layout_two_by_two_window_with_one_candidate():
    layout = step_layout(width=2, levels=2, parents=_chains(1, 2))
    assert layout.offsets.tolist() == [0, 1, 1, 2, 1, 2]
    expected = _grid(
        [
            "x.....",
            "xx....",
            "x.x...",
            "xx.x..",
            "x...x.",
            "x...xx",
        ]
    )
    assert torch.equal(layout.visible, expected)
    assert layout.logit_rows.tolist() == [0, 2, 3, 4, 5]


def test_layout_three_levels_and_two_candidates():
    layout = step_layout(width=3, levels=3, parents=_chains(2, 3))
    # window (r, j) -> index 3r + j at offset r + j; candidates at 9..11 and 12..14
    assert layout.offsets.tolist() == [0, 1, 2, 1, 2, 3, 2, 3, 4, 1, 2, 3, 1, 2, 3]
    # token (2, 1) = index 7 sees (0, 0), (0, 1), (1, 1), (2, 1)
    assert layout.visible[7].nonzero().flatten().tolist() == [0, 1, 4, 7]
    # token (1, 2) = index 5 sees row 0 up to column 2 and itself
    assert layout.visible[5].nonzero().flatten().tolist() == [0, 1, 2, 5]
    # the second candidate's third token sees last and its own first two tokens only
    assert layout.visible[14].nonzero().flatten().tolist() == [0, 12, 13, 14]
    assert layout.logit_rows.tolist() == [0, 6, 7, 8, *range(9, 15)]


def test_layout_positions_are_one_contiguous_sequence_per_token():
    """Every token sees exactly one token at each position p..p+offset: a valid sequence."""
    trees = [(), _chains(1, 2), _chains(3, 4), TokenTree.build([(1, 2, 3), (1, 2, 4), (1, 5), (6,)]).parents]
    for width, levels, parents in itertools.product([1, 2, 4], [1, 2, 4], trees):
        layout = step_layout(width, levels, parents)
        for index in range(layout.num_tokens):
            seen = layout.offsets[layout.visible[index]].sort().values.tolist()
            assert seen == list(range(int(layout.offsets[index]) + 1)), (width, levels, parents, index)


def test_window_chains_see_exactly_their_own_prefix():
    """Each chain token sits at the chain's next offset and sees ``last`` and the chain's earlier tokens only, so
    its logits verify the chain like a candidate's; every window token but ``last`` lies on some chain."""
    for width, levels in itertools.product([1, 2, 3, 5], [1, 2, 4]):
        layout = step_layout(width, levels, _chains(2, 3), chains=True)
        chains = window_chains(width, levels)
        for chain in chains:
            for k, index in enumerate(chain):
                assert int(layout.offsets[index]) == k + 1, (width, levels, chain)
                assert layout.visible[index].nonzero().flatten().tolist() == sorted([0, *chain[: k + 1]])
        assert {index for chain in chains for index in chain} == set(range(1, width * levels))


def test_window_logit_rows_follow_the_chained_layout():
    """With chains the layout reads every window token's logits: ``window_logit_row`` finds each one."""
    for width, levels, count in itertools.product([1, 3], [1, 2, 4], [0, 2]):
        parents = _chains(count, 3)
        layout = step_layout(width, levels, parents, chains=True)
        plain = step_layout(width, levels, parents)
        assert layout.logit_rows[: len(plain.logit_rows)].tolist() == plain.logit_rows.tolist()
        for index in range(1, width * levels):
            assert int(layout.logit_rows[window_logit_row(index, width, levels, len(parents))]) == index


def test_tree_layout_shares_prefixes():
    """(1, 2, 3), (1, 2, 4) and (1, 5) take 5 nodes instead of 8; each node sees last and its ancestors."""
    tree = TokenTree.build([(1, 2, 3), (1, 2, 4), (1, 5)])
    assert tree.tokens == (1, 2, 3, 4, 5) and tree.paths == ((0, 1, 2), (0, 1, 3), (0, 4))
    layout = step_layout(width=1, levels=1, parents=tree.parents)
    assert layout.offsets.tolist() == [0, 1, 2, 3, 3, 2]
    assert layout.visible[4].nonzero().flatten().tolist() == [0, 1, 2, 4]  # token 4 sees last, 1, 2, itself
    assert layout.visible[5].nonzero().flatten().tolist() == [0, 1, 5]  # token 5 sees last, 1, itself
    assert layout.logit_rows.tolist() == [0, 0, 1, 2, 3, 4, 5]


def test_window_fills_one_row_per_step_then_moves_up():
    counter = itertools.count(100)
    window = Window(width=3, levels=3, filler=lambda: next(counter))
    assert window.rows == [[100, 101, 102]]
    assert window.input_tokens(last=7) == [7, 101, 102]
    assert window.ngrams(7, [1, 2, 3]) == []
    window.advance([1, 2, 3], committed=1, align=True)
    assert window.rows == [[101, 102, 103], [2, 3, 104]]
    window.advance([4, 5, 6], committed=1, align=False)
    assert window.full
    assert window.ngrams(7, [7, 8, 9]) == [(7, (2, 4, 7)), (102, (3, 5, 8)), (103, (104, 6, 9))]
    window.advance([7, 8, 9], committed=1, align=True)
    assert window.rows == [[2, 3, 104], [4, 5, 6], [7, 8, 9]]


def test_aligned_window_shifts_by_committed_minus_one():
    counter = itertools.count(100)
    window = Window(width=3, levels=2, filler=lambda: next(counter))
    window.advance([1, 2, 3], committed=1, align=True)  # fill: shift by 1
    window.advance([4, 5, 6], committed=3, align=True)  # full: drop row 0, shift by 2
    assert window.rows == [[104, 105, 106], [6, 107, 108]]


def test_unaligned_window_never_shifts_columns():
    window = Window(width=2, levels=2, filler=lambda: 9)
    window.advance([1, 2], committed=3, align=False)
    window.advance([3, 4], committed=4, align=False)
    assert window.rows == [[1, 2], [3, 4]]


def test_skipped_steps_shift_the_rows_when_they_are_next_read():
    """Skips add up (capped at the width: a row then is all new fillers) and draw nothing until the rows are read;
    an unaligned window ignores them."""
    counter = itertools.count(100)
    window = Window(width=4, levels=2, filler=lambda: next(counter))
    window.advance([1, 2, 3, 4], committed=0, align=True)  # rows [[100..103], [1, 2, 3, 4]]
    window.skip(1, align=True)
    window.skip(2, align=True)
    assert window.depth == 2 and next(counter) == 104  # nothing drawn yet
    assert window.rows == [[103, 105, 106, 107], [4, 108, 109, 110]]  # shifted by 1 + 2
    window.skip(3, align=True)
    window.skip(5, align=True)
    assert window.rows == [[111, 112, 113, 114], [115, 116, 117, 118]]  # 8 columns: every one redrawn
    window.skip(2, align=False)
    assert window.rows == [[111, 112, 113, 114], [115, 116, 117, 118]]
    window.skip(1, align=True)
    assert window.input_tokens(last=7) == [7, 113, 114, 119, 116, 117, 118, 120]


def test_context_filler_skips_excluded_tokens_and_sees_appends():
    context = [5, 5, 5]
    draw = context_filler(context, exclude=frozenset({5}))
    assert draw() == 0  # nothing allowed yet
    context.append(6)
    assert {draw() for _ in range(20)} == {6}
