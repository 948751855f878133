"""The proposer seam: what a candidate source sees, returns and hears back, and the gate that decides when it pays.

Contract: a ``Proposer`` has a ``name`` (its ``source`` label in step stats and metrics), says whether its drafts
may be verified alone (``standalone``: a copy step, without the Jacobi window) or join the window's step, and
implements ``propose(context, budget)``: up to ``budget`` drafts, each a run of tokens guessed to follow
``context.tokens[-1]`` (runs that start alike are merged into one token tree by the step). ``expected`` is the
tokens it expects a step verifying its drafts to accept (its gate's running mean), and ``feedback(context,
outcome)`` hears, after every step, what was committed and, when some of its drafts were verified, how many of the
accepted guesses they proposed (``Outcome.reach``). A proposer applies its own gate in ``propose`` (returning no
drafts while verifying them does not pay) and updates it in ``feedback``. What paying means is priced per step:
``Context.price(tokens)`` is the accepted guesses that ``tokens`` more input tokens must bring for the step to
commit as many tokens per unit of step cost as it would without them (the step sets it from the step-cost curve
before it asks each proposer; 0 without a curve), and a gate pays at ``break_even(config, context, tokens)``:
that price for the drafts' tree, never below ``LookaheadConfig.break_even``. A proposer with ``top_k`` > 0 also hears
the model's top-k next tokens at every row the step read (``Outcome.successors``, keyed by each row's input token)
and at the row that chose the new ``last`` (``Outcome.runners_up``): the step computes them only when some
proposer asks.

Drafts are guesses only: the step verifies them against the model's own choices, so no proposer can change a
greedy output or a sampled one's distribution, only how many tokens a step commits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from decoding.params import LookaheadConfig
from decoding.proposers.pool import ContextIndex, covered
from decoding.proposers.survival import Survival

PROBE_INTERVAL = 8
MAX_PROBE_INTERVAL = 64
ACCEPT_SMOOTHING = 0.3

Draft = tuple[int, ...]
Price = Callable[[int], float]  # input tokens -> the accepted guesses they must bring to pay for themselves


def free(tokens: int) -> float:
    """The price of any number of draft tokens where no step-cost curve is known: nothing."""
    return 0.0


@dataclass
class Context:
    """What proposers read of one decode: ``tokens`` (the live list of committed tokens, prompt first;
    ``tokens[-1]`` is ``last``), ``prompt_length``, ``index`` (where each token occurs in the prompt and output, as
    ``LookaheadConfig.prompt_pool`` / ``output_pool`` say; the step keeps it up to date), ``stop_token_ids`` and
    ``price``, what draft tokens cost in accepted guesses at this point of this step (module contract)."""

    tokens: list[int]
    prompt_length: int
    index: ContextIndex
    stop_token_ids: frozenset[int]
    price: Price = free

    @property
    def last(self) -> int:
        """The newest committed token."""
        return self.tokens[-1]


@dataclass(frozen=True)
class Outcome:
    """What a step did, as every proposer hears it: ``committed`` tokens, the guessed tokens ``accepted`` (the
    winning draft's verified prefix), and ``reach``: how many of those this proposer's verified drafts proposed
    (their longest common prefix with ``accepted``), or None when none of its drafts was verified this step.
    For proposers with ``top_k``: ``successors``, per logits row the step read, ``(input token, its top-k next
    tokens, best first)``; ``runners_up``, the top-k tokens of the row that chose the new ``last`` (best first: the
    first is ``last`` itself on a greedy step). Both empty when no proposer asks for them."""

    committed: int
    accepted: tuple[int, ...] = ()
    reach: int | None = None
    successors: tuple[tuple[int, tuple[int, ...]], ...] = ()
    runners_up: tuple[int, ...] = ()


class Proposer(Protocol):
    """A candidate source (module contract)."""

    name: str
    standalone: bool
    top_k: int  # top tokens per logits row it wants to hear (0: none)
    in_guess_set: bool  # its drafts count toward G (``guess_set_size``) when it joins the window's step

    @property
    def expected(self) -> float: ...

    def propose(self, context: Context, budget: int) -> Sequence[Draft]: ...

    def feedback(self, context: Context, outcome: Outcome) -> None: ...


class Gate:
    """A running mean of the guesses a kind of step accepts, and whether taking such a step pays.

    ``pays(break_even)`` is True while the mean is at least ``break_even``; below it, for a probe that
    re-measures: after ``PROBE_INTERVAL`` calls, then after twice as many calls as the previous wait, up to
    ``MAX_PROBE_INTERVAL``, so text that never repeats pays for fewer and fewer probes. The wait starts over
    at ``PROBE_INTERVAL`` once the mean is back at ``break_even``. ``update`` folds in a step's accepted guesses.
    """

    def __init__(self, start: float) -> None:
        self.expected = start
        self.since_probe = 0
        self.interval = PROBE_INTERVAL

    def pays(self, break_even: float) -> bool:
        """Whether to verify this time (see the class contract); counts the call."""
        return self.pays_when(self.expected >= break_even)

    def pays_when(self, paying: bool) -> bool:
        """``pays`` where the caller judged whether verifying pays (``paying``) by its own estimate: True when it
        does, else on the probe schedule; counts the call."""
        if paying:
            self.since_probe, self.interval = 0, PROBE_INTERVAL
            return True
        self.since_probe += 1
        if self.since_probe < self.interval:
            return False
        self.since_probe = 0
        self.interval = min(2 * self.interval, MAX_PROBE_INTERVAL)
        return True

    def update(self, accepted: int) -> None:
        """Fold ``accepted`` guesses into the running mean."""
        self.expected += ACCEPT_SMOOTHING * (accepted - self.expected)


class Span:
    """How far the best copy of a copy step reaches: ``base`` tokens, doubled (up to ``limit``) after each copy
    step that accepted a whole copy of the current length, back to ``base`` after one that accepted less.

    >>> span = Span(16, 64)
    >>> lengths = []
    >>> for copied in (16, 32, 64, 64, 40):
    ...     span.update(copied)
    ...     lengths.append(span.length)
    >>> lengths
    [32, 64, 64, 64, 16]
    """

    def __init__(self, base: int, limit: int) -> None:
        self.base = base
        self.limit = max(base, limit)
        self.length = base

    def update(self, copied: int) -> None:
        """Double after a whole copy, else start over at ``base``."""
        self.length = min(2 * self.length, self.limit) if copied >= self.length else self.base


class GatedCopies:
    """What the copy-like proposers (context copies, the shared memory, the prediction) share: a ``gate`` that
    starts at ``start`` accepted tokens, an optional ``span`` that stretches after whole copies, drafts dropped while
    the gate says they do not pay (``gated``), and feedback that folds a step's reach into both. A subclass sets
    ``config`` and implements ``propose`` through ``gated``, or through ``sized``: copies cut to the length that pays
    on the step-cost curve (``decoding.proposers.survival``: how far this decode's copies were accepted, after at
    least twice the last verified copy's length when that one was accepted whole, since the estimate learns nothing
    past a copy's end), gated at that length's price (``config.break_even`` where no curve prices them)."""

    config: LookaheadConfig

    def __init__(self, start: float, span: Span | None = None) -> None:
        self.gate = Gate(start)
        self.span = span
        self.survival = Survival()
        self._sized: float | None = None  # accepted tokens the last ``sized`` copies expected (None: not sized)
        self._offered = 0  # the tokens of the best copy ``sized`` last proposed
        self._grow = 1  # the least length of the next sized copies

    @property
    def expected(self) -> float:
        return self.gate.expected if self._sized is None else self._sized

    def gated(self, context: Context, drafts: Sequence[Draft]) -> Sequence[Draft]:
        """``drafts``, or none while the gate says verifying them does not pay at their price (each call with
        drafts counts)."""
        if drafts and not self.gate.pays(break_even(self.config, context, tree_size(drafts))):
            return ()
        return drafts

    def sized(self, context: Context, found: Sequence[Draft], limit: int) -> Sequence[Draft]:
        """``found`` (best first) cut to the length that pays (at most ``limit``; every copy but the best at most
        ``copy_length``), or none while that length's expected accepted tokens do not reach its price (each call
        with copies counts)."""
        if not found:
            return ()
        length, expected = self.survival.best(context.price, limit)
        if length < self._grow:
            length = min(self._grow, limit)
            expected = self.survival.expected(length)
        drafts = stretched([copy[:length] for copy in found], min(length, self.config.copy_length))
        floor = self.config.break_even if context.price is free else context.price(tree_size(drafts))
        if not self.gate.pays_when(expected >= floor):
            return ()
        self._sized, self._offered = expected, len(drafts[0])
        return drafts

    def feedback(self, context: Context, outcome: Outcome) -> None:
        """Fold how far the drafts reached into the gate, the span and (after sized copies) the survival estimate."""
        if outcome.reach is None:
            return
        self.gate.update(outcome.reach)
        if self.span is not None:
            self.span.update(outcome.reach)
        if self._sized is not None:
            offered = max(self._offered, outcome.reach)
            self.survival.update(offered, outcome.reach)
            self._grow = 2 * offered if outcome.reach >= offered else 1


def break_even(config: LookaheadConfig, context: Context, tokens: int) -> float:
    """The accepted guesses a gate needs to verify ``tokens`` draft tokens: their price on this step, at least
    ``config.break_even``."""
    return max(config.break_even, context.price(tokens))


def tree_size(drafts: Sequence[Draft]) -> int:
    """Input tokens ``drafts`` take merged into one token tree (their distinct prefixes).

    >>> tree_size([(1, 2, 3), (1, 2, 4), (5,)])
    5
    """
    return len({tuple(draft[:end]) for draft in drafts for end in range(1, len(draft) + 1)})


def stretched(found: Sequence[Draft], length: int) -> list[Draft]:
    """``found`` (best first) with every continuation but the first cut to ``length`` tokens; one that its cut
    leaves a prefix of a continuation kept before it is dropped.

    >>> stretched([(1, 2, 3, 4), (5, 6, 7), (1, 2, 8)], 2)
    [(1, 2, 3, 4), (5, 6)]
    """
    kept: list[Draft] = []
    for index, continuation in enumerate(found):
        cut = continuation if index == 0 else continuation[:length]
        if not covered(cut, kept):
            kept.append(cut)
    return kept


def common_prefix(draft: Sequence[int], accepted: Sequence[int]) -> int:
    """How many leading tokens ``draft`` shares with ``accepted``.

    >>> common_prefix((4, 5, 9), (4, 5, 6))
    2
    """
    count, limit = 0, min(len(draft), len(accepted))
    while count < limit and draft[count] == accepted[count]:
        count += 1
    return count
