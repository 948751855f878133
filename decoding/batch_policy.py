"""The batch's policy: how one forward spends its tokens, and the payoff guard an engine keeps under it.

Contract: ``BatchPolicy`` holds a batch's settings (token budget, prefill chunk, the step-cost curve and the static
step's mode, see its fields) and prices forwards on its curve (``cost``, ``stream_cost``, ``padded_tokens``: with a
static step, a forward costs its padded bucket). ``allocate(proposals, policy)`` shares one forward's token budget
among the streams' proposals: every decoding stream its one token, prompts their chunks, then lookahead where the
curve says it pays (see its docstring). ``engine_guard(policy)`` is the ``decoding.payoff.PayoffGuard`` an engine
keeps under ``policy`` (None where it keeps none). Pure policy: no stream, model or tensor is touched here.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from decoding.forward.static import TOKEN_BUCKETS, bucket_shape
from decoding.payoff import PayoffGuard, WallCurve
from decoding.step.stream import Proposal

# Relative cost of one engine forward by input tokens, over a 300-token cache: SmolLM2-135M, float32 with packed
# linears and the panel kernel's AVX-512 entry, 1 thread (configs/cpu.yaml's curve, `python -m bench --step-cost`,
# 2026-11-25).
# The tuner measures the real curve.
CPU_STEP_COST = ((1, 1.0), (2, 1.07), (4, 1.16), (8, 1.27), (16, 1.41), (32, 1.99), (64, 3.28), (128, 5.85))


@dataclass(frozen=True)
class BatchPolicy:
    """How one batched forward spends its tokens.

    - ``max_step_tokens``: input tokens of one forward, all streams together (each decoding stream still
      gets its one token when there are more streams than that).
    - ``prefill_chunk``: prompt tokens per forward while other streams are running.
    - ``step_cost``: ``(tokens, relative cost)`` points of the step-cost curve, ascending; linear in between
      and beyond the last point.
    - ``static_step``: ``"off"`` (every forward eager) or the ``decoding.forward.static`` mode of the engine's static
      step; with one, a forward is priced at the padded bucket it runs in (``padded_tokens``).
    - ``static_sequences``: rows of the static step's KV pool (decodes at once; more run eagerly).
    - ``measure_step_cost``: the engine's builder (``decoding.decoder.Decoder.batch_engine``) replaces
      ``step_cost`` with the curve it measures on the device (``decoding.calibration``); ``step_cost`` is then
      the fallback.
    - ``prefix_cache_tokens``: tokens of finished decodes' KV the engine keeps for later prompts that start the
      same way (``decoding.step.prefix_cache``; 0: off).
    - ``payoff_guard``: whether the engine keeps a payoff guard where it would (``engine_guard``); False: never.
    """

    max_step_tokens: int = 128
    prefill_chunk: int = 128
    step_cost: tuple[tuple[int, float], ...] = CPU_STEP_COST
    static_step: str = "off"
    static_sequences: int = 16
    measure_step_cost: bool = False
    prefix_cache_tokens: int = 0
    payoff_guard: bool = True

    def cost(self, tokens: int) -> float:
        """The curve's relative cost of a forward over ``tokens`` input tokens."""
        return _interpolated(self.step_cost, tokens)

    def stream_cost(self, tokens: int) -> float:
        """The relative cost of a forward over one stream's ``tokens`` (padded as ``padded_tokens`` says): what
        a stream's drafts are priced on (``DecodeStream.propose``)."""
        return self.cost(self.padded_tokens([tokens]))

    def padded_tokens(self, budgets: Sequence[int]) -> int:
        """The input tokens a forward over streams with these token ``budgets`` (0: sits out) costs: their sum
        eagerly; with a static step, its bucket's ``sequences x tokens`` (the sum when it fits no bucket).

        >>> BatchPolicy(static_step="graphs").padded_tokens([1, 20, 1, 0])  # 3 -> 4 sequences, 20 -> 32 tokens
        128
        """
        running = [budget for budget in budgets if budget]
        shape = bucket_shape(len(running), max(running)) if self.static_step != "off" and running else None
        return sum(running) if shape is None else shape[0] * shape[1]

    def fits(self, budgets: Sequence[int]) -> bool:
        """Whether a forward over streams with these token ``budgets`` (0: sits out) runs in one of the static
        step's buckets; always true without a static step (nothing is padded, nothing falls back). A forward
        that fits none runs eagerly, at a cost the measured curve (graph replays) does not price: on an H200,
        ~18 ms against ~4 ms.

        >>> policy = BatchPolicy(static_step="graphs")
        >>> policy.fits([1] * 7 + [128]), policy.fits([1] * 7 + [129]), BatchPolicy().fits([1] * 7 + [900])
        (True, False, True)
        """
        running = [budget for budget in budgets if budget]
        return self.static_step == "off" or not running or bucket_shape(len(running), max(running)) is not None

    def widest_fitting(self, sequences: int) -> int | None:
        """The most tokens one of ``sequences`` running streams may take with the forward still in a bucket
        (the others at one token each); None without a static step (no bound), 0 when no bucket holds them.

        >>> BatchPolicy(static_step="graphs").widest_fitting(8), BatchPolicy().widest_fitting(8)
        (128, None)
        """
        if self.static_step == "off":
            return None
        return max((tokens for tokens in TOKEN_BUCKETS if bucket_shape(sequences, tokens) is not None), default=0)


def allocate(proposals: Sequence[Proposal], policy: BatchPolicy) -> list[int]:
    """Token budgets for one forward, one per proposal; 0 means the stream sits this forward out.

    Decoding streams get one token each; prefilling streams share ``prefill_chunk`` tokens first come first
    served (the first always gets at least one; a lone stream gets its whole prompt); then, most expected
    gain per extra token first, a decoding stream gets its proposed step, or else its smallest verifying step
    (one candidate, no window), when that fits in ``max_step_tokens`` and either it is a probe (acceptance
    must be re-measured) or its expected gain raises committed tokens per unit of step cost (of the padded
    bucket, with a static step: ``BatchPolicy.padded_tokens``). The gain of the smaller step is taken to be the
    full step's: the stream's acceptance estimate then tracks what it gets. With a static step, no step leaves
    the buckets for an eager forward (``BatchPolicy.fits``): prefill chunks shrink to fit, and a draft that would
    not fit is not taken.
    """
    if len(proposals) == 1:
        return [proposals[0].tokens]
    budgets = [1] * len(proposals)
    prefill_left = max(1, policy.prefill_chunk)
    for index, proposal in enumerate(proposals):
        if proposal.prefill:
            budgets[index] = min(proposal.tokens, prefill_left)
            prefill_left -= budgets[index]
    _fit_prefill(proposals, budgets, policy)
    used = sum(budgets)
    expected = float(sum(1 for proposal in proposals if not proposal.prefill))
    wanting = [i for i, p in enumerate(proposals) if not p.prefill and p.tokens > 1]
    wanting.sort(key=lambda i: proposals[i].gain / (proposals[i].tokens - 1), reverse=True)
    for index in wanting:
        proposal = proposals[index]
        for extra in (proposal.tokens - 1, proposal.smallest - 1):
            if extra < 1 or used + extra > policy.max_step_tokens:
                continue
            trial = [*budgets[:index], budgets[index] + extra, *budgets[index + 1 :]]
            if not policy.fits(trial) and policy.fits(budgets):
                continue  # it would leave the static step's buckets for an eager forward
            pays = (expected + proposal.gain) / policy.cost(policy.padded_tokens(trial)) > \
                expected / policy.cost(policy.padded_tokens(budgets))
            if proposal.probe or pays:
                budgets[index] += extra
                used += extra
                expected += proposal.gain
                break
    return budgets


def _fit_prefill(proposals: Sequence[Proposal], budgets: list[int], policy: BatchPolicy) -> None:
    """Shrink the prefill chunks of ``budgets`` (in place; each keeps at least one token) so that, with a static
    step, a forward beside other streams stays in a bucket (``BatchPolicy.fits``)."""
    if policy.fits(budgets):
        return
    widest = max(1, policy.widest_fitting(sum(1 for budget in budgets if budget)) or 1)
    for index, proposal in enumerate(proposals):
        if proposal.prefill and budgets[index] > widest:
            budgets[index] = widest


def engine_guard(policy: BatchPolicy) -> PayoffGuard | None:
    """The payoff guard of an engine under ``policy`` (``decoding.payoff``): on with a static step or a measured
    curve, which both presets' policies have (CUDA: a wide window runs every step, priced by no gate; CPU: the lazy
    window and ``break_even`` gate each verifying step on its expected gain, the guard checks what it realised), off
    otherwise or with ``policy.payoff_guard`` false; with ``measure_step_cost``, its price is measured online too
    (``WallCurve``), bucketed as the static step pads a lone stream (without one, by powers of two).

    >>> engine_guard(BatchPolicy()) is None, engine_guard(BatchPolicy(static_step="graphs")).wall is None
    (True, True)
    >>> engine_guard(BatchPolicy(static_step="graphs", payoff_guard=False)) is None
    True
    >>> guard = engine_guard(BatchPolicy(static_step="graphs", measure_step_cost=True))
    >>> guard.wall is not None, guard.bucket(300), engine_guard(BatchPolicy(measure_step_cost=True)).bucket(300)
    (True, 384, 512)
    """
    if not policy.payoff_guard or (policy.static_step == "off" and not policy.measure_step_cost):
        return None
    if policy.static_step != "off":
        def bucket(tokens: int) -> int:
            return policy.padded_tokens([tokens])
    else:
        def bucket(tokens: int) -> int:
            return 1 << (tokens - 1).bit_length()
    return PayoffGuard(policy.stream_cost, bucket, WallCurve() if policy.measure_step_cost else None)


@functools.lru_cache(maxsize=4096)
def _interpolated(points: tuple[tuple[int, float], ...], tokens: int) -> float:
    """``points``' piecewise-linear value at ``tokens`` (extended from the end segments), remembered: a lookahead
    step asks the same few sizes several times on every step."""
    xs = [x for x, _ in points]
    index = min(max(bisect.bisect_left(xs, tokens), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[index - 1], points[index]
    return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
