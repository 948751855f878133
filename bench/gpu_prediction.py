"""What a decode measured here would cost on the H200: each forward priced on the GPU's measured step curve.

Contract: ``predict(runs)`` takes the held-out records of our own decodes (``RunRecord.step_tokens``: the input
tokens of each forward) and prices every forward, padded to the static step's token bucket it replays
(``decoding.forward.static.TOKEN_BUCKETS``), at ``STEP_MS`` (``H200_STEP_MS``: the whole static step, one sequence,
measured on an H200 on 2026-11-28 up to 128 tokens, past that the server's measured relative curve of that day times the
one-token step; linear between points and past the last one; ``H100_GRAPH_MS``, the H100's graph replays of
2026-11-27, ``../shared/docs/gpu-notes.md``, kept for reference) plus the engine's host milliseconds per step of
its method (``HOST_MS``: ``python -m bench anatomy``'s replayed host work, greedy 0.03 ms and lookahead 0.31 ms on
2026-12-07), a lookahead decode's one-token steps (the payoff guard's rests, ``decoding.payoff``) at
``PLAIN_HOST_MS`` instead. It returns a ``Prediction``: the mean
input tokens of a lookahead step (prefill left out), the predicted seconds of each method, and lookahead's
predicted speed-up over greedy (prompts summed; the median per prompt). So the trade between tokens per step and
step size shows without a GPU: a preset that commits more tokens a step with much larger steps may still be slower
there. A prediction, not a measurement: the GPU check measures.

``relative_curve()`` is ``STEP_MS`` over its one-token step, made non-decreasing: the curve the server's calibration
measures on that GPU (``decoding.calibration``), for a ``BatchPolicy`` to price drafts on; ``predicted_wall(stats,
seconds)`` is a lookahead step's predicted seconds there (the payoff guard's measured price, simulated:
``python -m bench heldout --simulate-gpu``).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.records import RunRecord
from decoding.forward.static import TOKEN_BUCKETS
from decoding.step.steps import StepStats

# (input tokens, ms) of one CUDA-graph step, batch 1, the default model in float32, H100 (gpu-notes.md).
H100_GRAPH_MS = ((1, 3.52), (2, 4.37), (8, 4.40), (32, 4.52), (64, 4.90), (128, 5.23))
# (input tokens, ms) of one whole static step (graph replay and input packing), batch 1, the default model in float32,
# H200, 2026-11-28 (issue #42's GPU check), up to 128 tokens as measured (2 tokens took longer than 4 that day); past
# 128 the server's relative curve measured at start that day (192: 1.68, 256: 1.83, 384: 2.74, 512: 2.93) x 3.654.
H200_STEP_MS = ((1, 3.654), (2, 4.531), (4, 4.329), (8, 4.517), (16, 4.61), (32, 4.659), (64, 5.015), (96, 5.399),
                (128, 5.509), (192, 6.13), (256, 6.68), (384, 10.01), (512, 10.69))
STEP_MS = H200_STEP_MS
# The engine's host work a step with the device's work replayed (what a GPU's host pays: ``bench anatomy``'s
# ``step_host_ms_replayed``), AMD EPYC, 2026-12-07: greedy 0.03 ms (held out: 0.029 / 0.028 / 0.030); lookahead the
# median of the held-out sets' (``bench anatomy --held-out humaneval,chat,mtbench``: 0.367 / 0.313 / 0.184 ms on the
# default model at the CUDA preset). Was 0.22 / 2.00 (the thread time with the CPU's forward between steps, 2026-11-27).
HOST_MS = {"greedy": 0.03, "lookahead": 0.31}
# A lookahead decode's one-token step: bench anatomy's "rested" stream (no drafting; the plain step's finish, the
# window re-aligned, the proposers told, the recycled source's top-k read), replayed: 0.046 ms on the same day.
PLAIN_HOST_MS = 0.05


@dataclass(frozen=True)
class Prediction:
    """Lookahead against greedy on the GPU, predicted from the steps taken here."""

    mean_step_tokens: float | None  # input tokens per lookahead step, prefill left out
    greedy_seconds: float
    lookahead_seconds: float
    speedup: float | None  # greedy / lookahead, prompts summed
    median_speedup: float | None  # per prompt


def step_ms(tokens: int, curve: Sequence[tuple[int, float]] = STEP_MS) -> float:
    """Milliseconds of one graph step of ``tokens`` input tokens on ``curve`` (linear between points, and past
    the last along the last segment).

    >>> step_ms(1), step_ms(384), round(step_ms(640), 2)
    (3.654, 10.01, 11.37)
    >>> step_ms(5, H100_GRAPH_MS), round(step_ms(256, H100_GRAPH_MS), 2)
    (4.385, 5.89)
    """
    counts = [count for count, _ in curve]
    index = min(max(bisect.bisect_left(counts, tokens), 1), len(curve) - 1)
    (x0, y0), (x1, y1) = curve[index - 1], curve[index]
    return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


def padded(tokens: int) -> int:
    """The token bucket a one-sequence static step of ``tokens`` tokens replays (itself past the largest).

    >>> padded(1), padded(20), padded(300), padded(600)
    (1, 32, 384, 600)
    """
    return next((bucket for bucket in TOKEN_BUCKETS if bucket >= tokens), tokens)


def relative_curve(curve: Sequence[tuple[int, float]] = STEP_MS) -> tuple[tuple[int, float], ...]:
    """``curve`` over its one-token step, made non-decreasing (as ``decoding.calibration`` makes what it measures):
    a ``BatchPolicy.step_cost``.

    >>> relative_curve()[:3], relative_curve()[-2]
    (((1, 1.0), (2, 1.24), (4, 1.24)), (384, 2.739))
    """
    points, highest = [], 0.0
    for tokens, ms in curve:
        highest = max(highest, round(ms / curve[0][1], 3))
        points.append((tokens, highest))
    return tuple(points)


def predicted_wall(stats: StepStats, seconds: float = 0.0) -> float:
    """The predicted seconds of a lookahead decode's step on the GPU, whatever it took here (``seconds``, ignored):
    its bucket on ``STEP_MS`` plus the host work of a lookahead step, or of a plain one (one input token).

    >>> round(predicted_wall(StepStats(340, 3)), 5), round(predicted_wall(StepStats(1, 1)), 6)
    (0.01032, 0.003704)
    """
    host = HOST_MS["lookahead"] if stats.input_tokens > 1 else PLAIN_HOST_MS
    return (step_ms(padded(stats.input_tokens)) + host) / 1000


def decode_seconds(run: RunRecord, host_ms: float, plain_host_ms: float | None = None) -> float:
    """Predicted seconds of ``run`` on the GPU: each forward, padded to its bucket, on the step curve plus
    ``host_ms``; a one-token step after the prefill plus ``plain_host_ms`` instead, when given."""
    plain = host_ms if plain_host_ms is None else plain_host_ms
    return sum(step_ms(padded(tokens)) + (plain if tokens == 1 and index >= run.prefill_steps else host_ms)
               for index, tokens in enumerate(run.step_tokens or ())) / 1000


def predict(runs: Sequence[RunRecord], host_ms: Mapping[str, float] = HOST_MS,
            plain_host_ms: float = PLAIN_HOST_MS) -> Prediction | None:
    """The ``Prediction`` for the prompts that have both a greedy and a lookahead record with their step sizes;
    None when there are none. A lookahead decode's one-token steps cost ``plain_host_ms`` of host work."""
    pairs: dict[str, dict[str, RunRecord]] = {}
    for run in runs:
        if run.method in host_ms and run.step_tokens:
            pairs.setdefault(run.id, {})[run.method] = run
    pairs = {prompt: methods for prompt, methods in pairs.items() if len(methods) == len(host_ms)}
    if not pairs:
        return None
    greedy = [decode_seconds(methods["greedy"], host_ms["greedy"]) for methods in pairs.values()]
    lookahead = [decode_seconds(methods["lookahead"], host_ms["lookahead"], plain_host_ms)
                 for methods in pairs.values()]
    sizes = [tokens for methods in pairs.values()
             for tokens in methods["lookahead"].step_tokens[methods["lookahead"].prefill_steps:]]
    return Prediction(
        mean_step_tokens=round(statistics.fmean(sizes), 1) if sizes else None,
        greedy_seconds=round(sum(greedy), 3),
        lookahead_seconds=round(sum(lookahead), 3),
        speedup=round(sum(greedy) / sum(lookahead), 3) if sum(lookahead) else None,
        median_speedup=round(statistics.median(g / la for g, la in zip(greedy, lookahead, strict=True)), 3),
    )


def describe(prediction: Prediction) -> str:
    """One line for the held-out report."""
    return (f"predicted on the H200 (step curve of 2026-11-28, host {HOST_MS['greedy']:g} / "
            f"{HOST_MS['lookahead']:g} ms a step, {PLAIN_HOST_MS:g} a lookahead decode's plain step): lookahead "
            f"{prediction.speedup}x greedy (median {prediction.median_speedup}x), {prediction.mean_step_tokens} "
            "input tokens a lookahead step")
