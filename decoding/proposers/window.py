"""The 2-D Jacobi window and the layout of one lookahead step (token order, positions, attention mask).

Contract: a step's input is ``last`` and the rest of window row 0, then rows 1..L-1 (the lookahead branch,
``L·W`` tokens), then the nodes of a token tree of candidates (the verification branch, ``decoding.step.tree``;
candidates sharing a prefix share its nodes). ``step_layout``
returns, for that shape, the position offsets from ``p`` (the position of ``last``), the ``[q, q]`` attention
mask among the step's tokens, and the rows whose logits are read. Every step token also sees the whole KV
cache; the caller prepends those columns.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepLayout:
    """One step's shape; built once per shape and reused. The Python ints are made up front; the tensors an eager
    forward needs, when first read (a static step, ``decoding.forward.static``, reads only the ints).

    - ``offset_values`` / ``offsets`` ``[q]``: position of each input token minus ``p``.
    - ``parents`` (``q`` ints): each token's parent in the step (-1 for ``last``); ``visible[i]`` is exactly
      token ``i`` and its ancestors, so the mask can be rebuilt from ``parents`` alone.
    - ``visible`` ``[q, q]`` bool: ``visible[i, k]`` is True when token ``i`` attends to token ``k``.
    - ``row_values`` / ``logit_rows`` ``[1 + W + T (+ (L-1)·W - 1)]``: the input rows whose logits are read, in
      this order: ``last``, the bottom window row (W tokens), every tree node (T of them, in node order), then,
      for a layout with chains, the window's other tokens (indices 1 .. (L-1)·W - 1, see ``window_chains``).
    """

    offset_values: tuple[int, ...]
    row_values: tuple[int, ...]
    parents: tuple[int, ...]
    width: int
    levels: int

    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        return torch.tensor(self.offset_values, dtype=torch.long)

    @functools.cached_property
    def logit_rows(self) -> torch.Tensor:
        return torch.tensor(self.row_values, dtype=torch.long)

    @functools.cached_property
    def visible(self) -> torch.Tensor:
        """The window's part copied from ``_window_layout``; each tree node sees ``last``, its ancestors and itself."""
        window_tokens = self.levels * self.width
        total = len(self.parents)
        visible = torch.zeros(total, total, dtype=torch.bool)
        visible[:window_tokens, :window_tokens] = _window_layout(self.width, self.levels)[1]
        seen: list[list[int]] = []  # per tree node: the step indices it sees, ``last`` included
        rows: list[int] = []
        for index in range(window_tokens, total):
            parent = self.parents[index]
            seen.append([*(seen[parent - window_tokens] if parent >= window_tokens else [0]), index])
            rows.extend([index] * len(seen[-1]))
        if seen:
            visible[rows, [column for node_seen in seen for column in node_seen]] = True
        return visible

    @property
    def num_tokens(self) -> int:
        """Input tokens of the step (q)."""
        return len(self.offset_values)


@functools.lru_cache(maxsize=512)
def step_layout(width: int, levels: int, parents: tuple[int, ...] = (), chains: bool = False) -> StepLayout:
    """Layout of a step with an ``levels`` x ``width`` window and a token tree of candidates (on the CPU).

    ``parents`` is the tree's parent of each node (``decoding.step.tree.TokenTree.parents``: -1 for a child of
    ``last``, parents before children). Window token (r, j) sits at offset r + j and sees row-0 tokens (0, j')
    for j' <= j and the tokens (r', j) of its column for 1 <= r' <= r. Tree node i at depth d sits at offset d
    and sees ``last``, its ancestors and itself. Example, W=2, L=2, one candidate of two tokens (parents
    ``(-1, 0)``; indices: window 0..3, tree 4..5)::

        offsets 0 1 1 2 1 2      visible   0 1 2 3 4 5
                                      0    x
                                      1    x x
                                      2    x   x
                                      3    x x   x
                                      4    x       x
                                      5    x       x x
    """
    window_tokens = levels * width
    total = window_tokens + len(parents)
    window_offsets, _ = _window_layout(width, levels)
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    bottom_start = (levels - 1) * width
    upper = range(1, bottom_start) if chains else ()
    rows = (0, *range(bottom_start, window_tokens), *range(window_tokens, total), *upper)
    window_parents = [(row - 1) * width + column if row else column - 1
                      for row in range(levels) for column in range(width)]
    tree_parents = [window_tokens + parent if parent >= 0 else 0 for parent in parents]
    return StepLayout((*window_offsets, *depths), rows, (*window_parents, *tree_parents), width, levels)


@functools.lru_cache(maxsize=64)
def _window_layout(width: int, levels: int) -> tuple[tuple[int, ...], torch.Tensor]:
    """The window's part of ``step_layout``: each window token's offset and the ``[L·W, L·W]`` mask among them
    (read only: ``step_layout`` copies it into each step's mask)."""
    window_tokens = levels * width
    offsets = tuple(row + column for row in range(levels) for column in range(width))
    visible = torch.zeros(window_tokens, window_tokens, dtype=torch.bool)
    for row in range(levels):
        for column in range(width):
            index = row * width + column
            visible[index, : column + 1] = True
            for upper in range(1, row + 1):
                visible[index, upper * width + column] = True
    return offsets, visible


@functools.lru_cache(maxsize=512)
def window_chains(width: int, levels: int) -> tuple[tuple[int, ...], ...]:
    """The window's causal chains, as window indices: for column j, row 0's tokens 1..j, then column j's
    tokens in rows 1..levels-1 (chains of no token left out).

    In ``step_layout``'s mask each token of a chain sees ``last`` and exactly the chain's earlier tokens, at
    offsets 1, 2, ...: its logits are those of the chain's text, so a chain is verified like a candidate, for
    no extra input token (only extra logit rows). Example, W=2, L=3 (window indices 0..5, row-major)::

        >>> window_chains(2, 3)
        ((2, 4), (1, 3, 5))
    """
    chains = []
    for column in range(width):
        chain = (*range(1, column + 1), *(row * width + column for row in range(1, levels)))
        if chain:
            chains.append(chain)
    return tuple(chains)


def window_logit_row(index: int, width: int, levels: int, tree_nodes: int) -> int:
    """The logit row of window token ``index`` (not 0) in a layout with chains and ``tree_nodes`` tree nodes.

    >>> [window_logit_row(index, 2, 3, tree_nodes=1) for index in range(1, 6)]
    [4, 5, 6, 1, 2]
    """
    bottom_start = (levels - 1) * width
    if index >= bottom_start:
        return 1 + index - bottom_start
    return width + tree_nodes + index


class Window:
    """The Jacobi window: up to ``levels`` rows of ``width`` guessed tokens.

    Row r, column j holds a guess for position ``p + r + j``; row 0 column 0 stands for ``last`` and is
    replaced by it in the step input. The window starts with one row drawn from the context and gains a
    row per step until it has ``levels`` rows; after that each step drops row 0 (the rows move up one
    level) and appends the new row read off the bottom row's logits. Steps that do not run it (``skip``) only
    count how far its rows must shift; they shift, and draw their new fillers, when the rows are next read (a
    lazy window skips most steps: each shift redrew whole rows that the next skip threw away).
    """

    def __init__(self, width: int, levels: int, filler: Callable[[], int]) -> None:
        self.width = width
        self.levels = levels
        self.filler = filler
        self._rows: list[list[int]] = [[filler() for _ in range(width)]]
        self._pending = 0  # columns every row still has to shift left (skipped steps), at most width

    @property
    def rows(self) -> list[list[int]]:
        """The rows, aligned after every step so far."""
        if self._pending:
            self._rows = [self._shift(row, self._pending) for row in self._rows]
            self._pending = 0
        return self._rows

    @property
    def depth(self) -> int:
        """How many rows the window has (``len(rows)`` without aligning them)."""
        return len(self._rows)

    @property
    def full(self) -> bool:
        """True once the window has all its rows, so every column yields a complete n-gram."""
        return len(self._rows) == self.levels

    def input_tokens(self, last: int) -> list[int]:
        """The lookahead branch's tokens: ``last``, the rest of row 0, then rows 1.. in order."""
        rows = self.rows
        tokens = [last, *rows[0][1:]]
        for row in rows[1:]:
            tokens.extend(row)
        return tokens

    def ngrams(self, last: int, new_row: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
        """For each column j, ``(row0[j], (row1[j], ..., new_row[j]))``: an n-gram on consecutive positions.

        Column 0 of row 0 is ``last``, as fed to the model. Empty until the window has all its rows.
        """
        if not self.full:
            return []
        rows = self.rows
        columns = zip(*rows[1:], new_row, strict=True)  # column j of rows 1.. and of the new row
        return [(last, next(columns)), *zip(rows[0][1:], columns, strict=True)]

    def advance(self, new_row: Sequence[int], committed: int, align: bool) -> None:
        """Append ``new_row`` (dropping row 0 when full) and re-align after ``committed`` tokens.

        With ``align``, every row shifts left so that column j again guesses position ``p' + r + j`` for the
        new ``p' = p + committed``; the vacated right-hand columns are refilled from the context.
        """
        rows = self.rows
        rows.append(list(new_row))
        moved_up = len(rows) > self.levels
        if moved_up:
            rows.pop(0)
        shift = committed - 1 if moved_up else committed
        if align and shift > 0:
            self._rows = [self._shift(row, shift) for row in rows]

    def skip(self, committed: int, align: bool) -> None:
        """Account for a step that did not run the window: re-align after ``committed`` tokens, no new row (the
        shift is made when the rows are next read)."""
        if align and committed > 0:
            self._pending = min(self._pending + committed, self.width)

    def _shift(self, row: list[int], shift: int) -> list[int]:
        kept = row[shift:]
        return kept + [self.filler() for _ in range(self.width - len(kept))]


def context_filler(context: list[int], exclude: frozenset[int] = frozenset(), seed: int = 0) -> Callable[[], int]:
    """A function drawing tokens uniformly from ``context`` (a live list: later appends are seen).

    Tokens in ``exclude`` (EOS and other stop tokens) are never returned: a few redraws, then the most
    recent context token that is not excluded (or token 0 if there is none).
    """
    rng = random.Random(seed)

    def draw() -> int:
        for _ in range(8):
            token = context[rng.randrange(len(context))]
            if token not in exclude:
                return token
        return next((token for token in reversed(context) if token not in exclude), 0)

    return draw
