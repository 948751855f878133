"""The payoff guard: a lookahead decode whose steps do not pay against plain one-token steps takes plain steps a while.

Contract: ``PayoffGuard(curve)`` watches the running decodes of one engine, each under a key of the caller's.
``record(key, stats)`` takes each step a decode took (its ``decoding.step.steps.StepStats``) and ``resting(key)`` says
before the next whether that decode should take a plain one-token step. A decode's lookahead is judged on its
verifying steps (input tokens > 1, prefill left out; its first ``warmup`` not judged: the Jacobi window is still
filling its rows): its efficiency over its last ``history`` verifying steps since it last rested is the tokens they
committed over their price (``cost(tokens)``: a step of ``tokens`` input tokens against a one-token step, so a plain
step commits 1 token for a price of 1). A trial (the decode's start, or after a rest) is judged after ``trial``
verifying steps; a decode that pays, every ``every`` more. Below 1 (lookahead is losing to plain steps) the decode
rests for ``rest`` steps, then tries again: a trial that fails rests it twice as long as the last rest (up to
``max_rest``), one that pays resets the rest to ``rest``. Short trials cost little where lookahead loses; a decode
that pays is judged seldom, over many steps (one step commits 1 to N tokens, more with copies: judged over 8 steps, a
decode that pays 10 % often looks like one that loses). A decode's second and later rests are at least as long as
the rest the last decode the guard forgot would have taken next (``forget``): where lookahead keeps losing, later
requests do not start over at ``rest``, while one whose first trial fails (a slow start) still rests only ``rest``.
Plain steps a decode takes on its own (a lazy window, a gate) are neither priced nor counted as verifying steps.
Deterministic: a decision depends only on the steps' sizes, their committed tokens and the price.

The price is ``curve`` (the batch policy's calibrated curve for one stream) unless a ``WallCurve`` measured online
knows better: ``observe(stats, seconds)`` adds the wall time of a step a decode took alone (prefill left out) to
its token bucket (``bucket(tokens)``: the static step's padding), and once both a step's bucket and the one-token
bucket hold ``MIN_SAMPLES`` samples, the step's price is the ratio of their medians: the engine's host work, which
the calibrated curve leaves out, is then priced too. While the one-token bucket has no price yet, a decode judged
to pay on the curve rests ``MIN_SAMPLES`` steps once, to measure it (with other decodes beside it, such a forward is
not a lone step: nothing is learnt, and it is not tried again).

Example (``trial=2, rest=2``, no warm-up, every verifying step of 5 tokens priced 2): steps committing 1 token each
do not pay (2 tokens for a price of 4), so after two of them the decode rests two steps; steps committing 3 pay:

>>> from decoding.step.steps import StepStats
>>> guard = PayoffGuard(lambda tokens: 2.0 if tokens > 1 else 1.0, trial=2, rest=2, warmup=0)
>>> verify, plain = StepStats(5, 1), StepStats(1, 1)
>>> resting = []
>>> for stats in (verify, verify, plain, plain, StepStats(5, 3)):
...     guard.record("a", stats)
...     resting.append(guard.resting("a"))
>>> resting
[False, True, True, False, False]
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decoding.step.steps import StepStats

# Chosen on the CUDA preset's steps on the tune split (chat, HumanEval; MT-bench's held-out, it has no tune split),
# priced on the H200's predicted walls, replayed offline against the decodes without the guard: docs/design.md. The
# CPU preset's guard runs with the same values (not tuned there).
WARMUP = 3  # a decode's first verifying steps, not judged: the CUDA preset's window (N = 5) fills its rows in N - 2
TRIAL = 4  # verifying steps a trial takes before it is judged: where lookahead loses, each costs
EVERY = 16  # verifying steps between judgements of a decode that pays: fewer judgements, fewer false alarms
HISTORY = 32  # the verifying steps judged together: a paying decode's slip is weighed against its good steps
REST = 8  # plain steps after the first failure
MAX_REST = 128  # the longest rest: a trial every 128 + 4 steps costs ~3 % of them where lookahead never pays
SAMPLES = 16  # recent wall times kept per bucket (their median is the bucket's time)
MIN_SAMPLES = 4  # wall times a bucket needs before its measured price replaces the curve's


class WallCurve:
    """Per token bucket, the wall seconds of the last ``samples`` steps (module contract); ``relative(bucket)`` is
    the median of its bucket's over the one-token bucket's, None until both hold ``min_samples``.

    >>> wall = WallCurve(min_samples=2)
    >>> for seconds in (0.004, 0.005, 0.004):
    ...     wall.add(1, seconds)
    >>> wall.add(384, 0.012)
    >>> wall.relative(384), wall.relative(1)
    (None, 1.0)
    >>> wall.add(384, 0.014)
    >>> wall.relative(384)
    3.25
    """

    def __init__(self, samples: int = SAMPLES, min_samples: int = MIN_SAMPLES) -> None:
        self.samples = samples
        self.min_samples = min_samples
        self._seconds: dict[int, deque[float]] = {}

    def add(self, bucket: int, seconds: float) -> None:
        """One step's wall ``seconds`` in ``bucket``."""
        self._seconds.setdefault(bucket, deque(maxlen=self.samples)).append(seconds)

    def seconds(self, bucket: int) -> float | None:
        """The median of ``bucket``'s recent wall times; None with fewer than ``min_samples``."""
        recent = self._seconds.get(bucket, ())
        return statistics.median(recent) if len(recent) >= self.min_samples else None

    def relative(self, bucket: int) -> float | None:
        """``bucket``'s time over the one-token bucket's; None until both are measured."""
        mine, one = self.seconds(bucket), self.seconds(1)
        return None if mine is None or not one else mine / one


@dataclass
class _Watch:
    """One decode's recent verifying steps ``(input tokens, committed)`` and where it stands."""

    next_rest: int
    warmup: int  # verifying steps left before it is judged at all
    recent: deque[tuple[int, int]] = field(default_factory=deque)
    fresh: int = 0  # verifying steps since the last judgement (or rest)
    trying: bool = True  # its next judgement is a trial's
    resting: int = 0  # plain steps left in the current rest
    sampled: bool = False  # it rested once to measure the one-token bucket
    rests: int = 0  # rests so far


class PayoffGuard:
    """Rests the decodes whose lookahead steps do not pay (module contract). ``curve``: the calibrated price of a
    step by input tokens; ``bucket``: the token bucket a step of that many tokens runs in (the wall curve's key);
    ``wall``: the online measured price (None: the curve alone)."""

    def __init__(
        self, curve: Callable[[int], float], bucket: Callable[[int], int] = int, wall: WallCurve | None = None,
        trial: int = TRIAL, every: int = EVERY, history: int = HISTORY, warmup: int = WARMUP, rest: int = REST,
        max_rest: int = MAX_REST,
    ) -> None:
        if not 1 <= trial <= history or not 1 <= every <= history or warmup < 0 or not 1 <= rest <= max_rest:
            raise ValueError("need 1 <= trial, every <= history, warmup >= 0 and 1 <= rest <= max_rest, got "
                             f"{trial}, {every}, {history}, {warmup}, {rest}, {max_rest}")
        self.curve, self.bucket, self.wall = curve, bucket, wall
        self.trial, self.every, self.history, self.warmup = trial, every, history, warmup
        self.rest, self.max_rest = rest, max_rest
        self._watches: dict[Hashable, _Watch] = {}
        self._carried = rest  # the next rest of the last decode forgotten

    def cost(self, tokens: int) -> float:
        """The price of a step of ``tokens`` input tokens against a one-token step: measured when the wall curve
        knows both buckets, else the curve's."""
        if tokens <= 1:
            return 1.0
        measured = self.wall.relative(self.bucket(tokens)) if self.wall is not None else None
        return measured if measured is not None else self.curve(tokens)

    def resting(self, key: Hashable) -> bool:
        """Whether ``key``'s decode takes a plain one-token step next."""
        watch = self._watches.get(key)
        return watch is not None and watch.resting > 0

    def rests(self, key: Hashable) -> int:
        """How many times ``key``'s decode has been rested so far."""
        watch = self._watches.get(key)
        return 0 if watch is None else watch.rests

    def efficiency(self, key: Hashable) -> float | None:
        """Committed tokens over the price of ``key``'s recent verifying steps (None before any)."""
        watch = self._watches.get(key)
        return None if watch is None or not watch.recent else self._efficiency(watch.recent)

    def record(self, key: Hashable, stats: StepStats) -> None:
        """Take the step ``key``'s decode just took; decide whether it rests from the next step on."""
        if stats.prefill:
            return
        watch = self._watches.get(key)
        if watch is None:
            if stats.input_tokens <= 1:
                return  # a decode that never verifies is never watched
            watch = self._watches[key] = _Watch(self.rest, self.warmup, deque(maxlen=self.history))
        if watch.resting:
            watch.resting -= 1
            return
        if stats.input_tokens <= 1:
            return
        if watch.warmup:
            watch.warmup -= 1
            return
        watch.recent.append((stats.input_tokens, stats.committed))
        watch.fresh += 1
        if watch.fresh < (self.trial if watch.trying else self.every):
            return
        watch.fresh, watch.trying = 0, False
        if self._efficiency(watch.recent) >= 1.0:
            watch.next_rest = self.rest
            if self.wall is not None and self.wall.seconds(1) is None and not watch.sampled:
                watch.sampled = True  # rest once to price the plain step the measured curve is relative to
                self._rest(watch, self.wall.min_samples)
            return
        self._rest(watch, watch.next_rest)
        watch.next_rest = min(max(2 * watch.next_rest, self._carried), self.max_rest)

    def observe(self, stats: StepStats, seconds: float) -> None:
        """The wall ``seconds`` of a step a decode took alone in its forward (prefill steps are not kept)."""
        if self.wall is not None and not stats.prefill:
            self.wall.add(self.bucket(stats.input_tokens) if stats.input_tokens > 1 else 1, seconds)

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s decode (it ended); the next rest it would have taken carries over to later decodes."""
        watch = self._watches.pop(key, None)
        if watch is not None:
            self._carried = watch.next_rest

    def _rest(self, watch: _Watch, steps: int) -> None:
        watch.resting, watch.fresh, watch.trying = steps, 0, True
        watch.rests += 1
        watch.recent.clear()

    def _efficiency(self, recent: deque[tuple[int, int]]) -> float:
        return sum(committed for _, committed in recent) / sum(self.cost(tokens) for tokens, _ in recent)
