"""A lookahead step's drafts: asked of the proposers at their price, cut by the grammar, merged in order.

Contract: ``gather(proposers, context, ..., into)`` asks each proposer in order for drafts, telling it first, through
``Context.price``, what more input tokens cost at that point of the step (``step_price`` on the step-cost curve
``cost``; free without one), cuts every draft before the first token the request's grammar forbids, and merges them
into ``into`` (a ``Gathered``, which a step's gathers share: one token tree grown draft by draft), whose ``shape``
is the step's ``Shape``: the drafts a step verifies, best first, each with its source, every proposer's drafts as
offered (to credit those merged into another's) and the best running mean among the proposers whose drafts it holds.
Standalone sources (``limit`` None, each at most ``copy_candidates``) skip a draft covered by one kept before; the
others keep at most ``limit`` drafts in all (among those that count toward G) and skip exact repeats (and, under a
grammar, covered ones). Every proposer is asked, even with no room left: a gate counts its calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from decoding.grammar import Constraint
from decoding.params import MAX_STEP_TOKENS
from decoding.proposers import Context, Draft, Proposer
from decoding.proposers.base import Price, free
from decoding.step.tree import TokenTree, TreeBuilder


@dataclass(frozen=True)
class Shape:
    """A step's shape: the window (or not), the drafts it verifies, best first, with each one's source; ``offered``
    every proposer's drafts as proposed (grammar-cut), to credit those merged into another's; ``gain`` the best
    running mean of the proposers whose drafts it holds; ``built``: their token tree when it was grown with them
    (else ``tree`` builds it)."""

    window: bool
    candidates: tuple[Draft, ...] = ()
    sources: tuple[str, ...] = ()
    offered: tuple[tuple[str, tuple[Draft, ...]], ...] = ()
    gain: float = 0.0
    built: TokenTree | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def tree(self) -> TokenTree:
        """The candidates merged into one token tree (built once per shape)."""
        return self.built if self.built is not None else TokenTree.build(self.candidates)

    def keep(self, count: int, window: bool | None = None) -> Shape:
        """The same step with only its first ``count`` candidates (and the window when ``window`` says so)."""
        window = self.window if window is None else window
        return Shape(window, self.candidates[:count], self.sources[:count], self.offered, self.gain,
                     self.tree.first(count))


class Gathered:
    """A step's drafts as ``gather`` keeps them, over one or more calls: their token tree (``kept``: the drafts and
    every prefix of them), each one's source, every proposer's drafts as offered, and the best gain among the
    proposers whose drafts it holds."""

    def __init__(self) -> None:
        self.kept = TreeBuilder()
        self.sources: list[str] = []
        self.offered: list[tuple[str, tuple[Draft, ...]]] = []
        self.gain = 0.0

    def __len__(self) -> int:
        """The drafts kept so far."""
        return len(self.sources)

    def shape(self, window: bool) -> Shape:
        """The drafts kept so far as a step's ``Shape`` (the gathering is done: its tree is the builder's)."""
        return Shape(window, tuple(self.kept.candidates), tuple(self.sources), tuple(self.offered), self.gain,
                     self.kept.tree())


def gather(proposers: Sequence[Proposer], context: Context, constraint: Constraint | None, copy_candidates: int,
           limit: int | None, cost: Callable[[int], float] | None, base: int, into: Gathered) -> Gathered:
    """The ``proposers``' drafts, merged (module contract) after those ``into`` holds (one token tree), each
    proposer told the price of more tokens on a step that holds ``base`` tokens plus the drafts kept before it and
    expects the best gain kept so far. ``limit`` counts this call's drafts alone; exact repeats are skipped within
    one call (a draft covered by one kept before it is skipped across calls too when the check is strict)."""
    kept = into.kept
    exact: set[Draft] = set()
    counted = 0  # drafts kept by this call that count toward ``limit``
    strict = limit is None or constraint is not None
    for proposer in proposers:
        within = limit is not None and proposer.in_guess_set
        room = copy_candidates if limit is None else limit - counted if within else MAX_STEP_TOKENS
        context.price = free if cost is None else step_price(cost, base + len(kept), into.gain)
        drafts = tuple(cut(proposer.propose(context, room), constraint))
        if not drafts:
            continue
        into.offered.append((proposer.name, drafts))
        taken = False
        for draft in drafts:
            if within and counted == limit:
                break
            if draft in kept if strict else draft in exact:
                continue
            counted += within
            kept.add(draft)
            exact.add(draft)
            into.sources.append(proposer.name)
            taken = True
        if taken:
            into.gain = max(into.gain, proposer.expected)
    context.price = free
    return into


def step_price(cost: Callable[[int], float], base: int, gain: float) -> Price:
    """The price of draft tokens on a step of ``base`` input tokens that expects to commit ``1 + gain``: the
    accepted guesses ``t`` more tokens must bring for the step to commit as many tokens per unit of ``cost``,
    ``(1 + gain) * (cost(base + t) / cost(base) - 1)``.

    >>> cost = lambda tokens: 1.0 + 0.25 * (tokens - 1)
    >>> step_price(cost, base=1, gain=0.0)(4), step_price(cost, base=5, gain=0.5)(4)
    (1.0, 0.75)
    """
    start: float | None = None  # cost(base), read on the first price asked (most steps' proposers ask none)

    def price(tokens: int) -> float:
        nonlocal start
        if start is None:
            start = cost(base)
        return (1.0 + gain) * (cost(base + tokens) / start - 1.0)

    return price


def cut(drafts: Sequence[Draft], constraint: Constraint | None) -> list[Draft]:
    """``drafts`` as tuples, each cut before the first token ``constraint`` forbids (emptied ones dropped).

    >>> cut([[1, 2], (3,)], None)
    [(1, 2), (3,)]
    """
    if constraint is None:
        return [tuple(draft) for draft in drafts]
    kept = [tuple(draft[: constraint.valid_prefix(draft)]) for draft in drafts]
    return [draft for draft in kept if draft]
