"""What a decode measured here would cost on the H100: each forward priced on the GPU's measured step curve.

Contract: ``predict(runs)`` takes the held-out records of our own decodes (``RunRecord.step_tokens``: the input
tokens of each forward) and prices every forward, padded to the static step's token bucket it replays
(``decoding.forward.static.TOKEN_BUCKETS``), at ``H100_GRAPH_MS`` (the static step's CUDA graph, one sequence,
measured on an H100 on 2026-11-27: ``../shared/docs/gpu-notes.md``; linear between points and past the last one)
plus the engine's host milliseconds per step of its method (``HOST_MS``: ``python -m bench anatomy --preset cuda``,
greedy 0.22 ms and lookahead 2.00 ms on 2026-11-27; the lookahead figure is what issue #42 is cutting to 0.5).
It returns a ``Prediction``: the mean input tokens of a lookahead step (prefill left out), the predicted seconds
of each method, and lookahead's predicted speed-up over greedy (prompts summed; the median per prompt). So the
trade between tokens per step and step size shows without a GPU: a preset that commits more tokens a step with
much larger steps may still be slower there. A prediction, not a measurement: the GPU check measures.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.records import RunRecord
from decoding.forward.static import TOKEN_BUCKETS

# (input tokens, ms) of one CUDA-graph step, batch 1, the default model in float32, H100 (gpu-notes.md).
H100_GRAPH_MS = ((1, 3.52), (2, 4.37), (8, 4.40), (32, 4.52), (64, 4.90), (128, 5.23))
HOST_MS = {"greedy": 0.22, "lookahead": 2.00}  # bench anatomy --preset cuda, 2026-11-27


@dataclass(frozen=True)
class Prediction:
    """Lookahead against greedy on the H100, predicted from the steps taken here."""

    mean_step_tokens: float | None  # input tokens per lookahead step, prefill left out
    greedy_seconds: float
    lookahead_seconds: float
    speedup: float | None  # greedy / lookahead, prompts summed
    median_speedup: float | None  # per prompt


def step_ms(tokens: int, curve: Sequence[tuple[int, float]] = H100_GRAPH_MS) -> float:
    """Milliseconds of one graph step of ``tokens`` input tokens on ``curve`` (linear between points, and past
    the last along the last segment).

    >>> step_ms(1), step_ms(5), round(step_ms(256), 2)
    (3.52, 4.385, 5.89)
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


def decode_seconds(run: RunRecord, host_ms: float) -> float:
    """Predicted seconds of ``run`` on the H100: each forward, padded to its bucket, on the graph curve plus
    ``host_ms``."""
    return sum(step_ms(padded(tokens)) + host_ms for tokens in run.step_tokens or ()) / 1000


def predict(runs: Sequence[RunRecord], host_ms: Mapping[str, float] = HOST_MS) -> Prediction | None:
    """The ``Prediction`` for the prompts that have both a greedy and a lookahead record with their step sizes;
    None when there are none."""
    pairs: dict[str, dict[str, RunRecord]] = {}
    for run in runs:
        if run.method in host_ms and run.step_tokens:
            pairs.setdefault(run.id, {})[run.method] = run
    pairs = {prompt: methods for prompt, methods in pairs.items() if len(methods) == len(host_ms)}
    if not pairs:
        return None
    greedy = [decode_seconds(methods["greedy"], host_ms["greedy"]) for methods in pairs.values()]
    lookahead = [decode_seconds(methods["lookahead"], host_ms["lookahead"]) for methods in pairs.values()]
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
    return (f"predicted on the H100 (graph curve of 2026-11-27, host {HOST_MS['greedy']:g} / "
            f"{HOST_MS['lookahead']:g} ms a step): lookahead {prediction.speedup}x greedy (median "
            f"{prediction.median_speedup}x), {prediction.mean_step_tokens} input tokens a lookahead step")
