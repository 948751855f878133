"""The step-cost curve measured where the server runs: what a forward of k input tokens costs against one token.

Contract: ``measure_step_cost(model, static, max_tokens)`` times one stream's forward of k input tokens, causal
over a cache already holding ``CONTEXT`` tokens, for each k of ``STEP_TOKENS`` up to ``max_tokens``, through
``decoding.batch.forward_batch``: the path the engine takes (the static step's bucket when one fits, as replayed
graphs on CUDA; else the eager forward: the fused CPU step, the lean step or the public forward). Each time is wall
clock around the whole call, its inputs' preparation and the read of its argmax ids to the host included (that
read waits for the device), so it is what a step pays apart from drafting and verifying. One untimed run, then
the median of up to ``REPEATS`` runs (fewer once a point has taken ``POINT_SECONDS``). Returns ``(k, cost(k) /
cost(1))`` points, made non-decreasing (noise never makes more tokens look cheaper), ready for
``BatchPolicy.step_cost``. The cache is dropped back to ``CONTEXT`` tokens after every run and freed at the end;
nothing else is touched. On the default model: ~2 s on a CPU at the CPU preset (k <= 128), well under a second
on a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from decoding.batch import forward_batch
from decoding.kv_cache import SlotCache, new_cache
from decoding.packed import Slice
from decoding.static import TOKEN_BUCKETS, StaticStep

CONTEXT = 256  # cached tokens under the timed steps: a conversation's first turn
STEP_TOKENS = TOKEN_BUCKETS  # 1, 2, 4, ..., 64, 96, 128, 192, 256, 384, 512: the static step's token buckets
REPEATS = 5
POINT_SECONDS = 1.0


def measure_step_cost(
    model: PreTrainedModel, static: StaticStep | None, max_tokens: int, steps: Sequence[int] = STEP_TOKENS,
    repeats: int = REPEATS,
) -> tuple[tuple[int, float], ...]:
    """The measured curve (module contract): ``(tokens, relative cost)`` for each of ``steps`` up to
    ``max_tokens`` (at least two points: 1 and the next)."""
    counts = [count for count in steps if count <= max_tokens] or [1]
    if counts[0] != 1:
        counts.insert(0, 1)
    if len(counts) < 2:
        counts.append(2)
    cache = _cache(model, static, CONTEXT + counts[-1])
    try:
        _fill(model, static, cache)
        seconds = [_median_seconds(model, static, cache, count, repeats) for count in counts]
    finally:
        if cache.pool is not None:
            cache.pool.release(cache)
    curve, highest = [], 0.0
    for count, spent in zip(counts, seconds, strict=True):
        highest = max(highest, spent / seconds[0])
        curve.append((count, round(highest, 3)))
    return tuple(curve)


def _cache(model: PreTrainedModel, static: StaticStep | None, capacity: int) -> SlotCache:
    """A pool row of the static step when there is one free (the engine's decodes run there), else a cache of
    the model's own."""
    cache = static.pool.acquire(capacity) if static is not None else None
    return cache if cache is not None else new_cache(model, capacity)


def _fill(model: PreTrainedModel, static: StaticStep | None, cache: SlotCache) -> None:
    """Prefill ``CONTEXT`` tokens into ``cache`` (in chunks of at most 128, as the engine's prefill runs)."""
    while cache.length < CONTEXT:
        count = min(128, CONTEXT - cache.length)
        forward_batch(model, [_slice(cache, count)], static)


def _slice(cache: SlotCache, count: int) -> Slice:
    """``count`` causal tokens after ``cache``'s, reading every row (as a lookahead step reads its tree's)."""
    start = cache.length
    tokens = [(7 * (start + offset)) % 1000 + 1 for offset in range(count)]  # in any vocabulary, not all alike
    return Slice(tokens, None, None, None, cache, host_positions=range(start, start + count),
                 host_rows=range(count))


def _median_seconds(
    model: PreTrainedModel, static: StaticStep | None, cache: SlotCache, count: int, repeats: int
) -> float:
    """Median wall seconds of a ``count``-token step over ``cache`` (module contract), dropped after each run."""
    spent: list[float] = []
    started = time.perf_counter()
    for run in range(repeats + 1):
        begin = time.perf_counter()
        logits, argmax = forward_batch(model, [_slice(cache, count)], static)
        if argmax[0] is None:  # the eager forward: the engine reads the argmax ids itself
            torch.argmax(logits[0], dim=-1).tolist()
        if run:
            spent.append(time.perf_counter() - begin)
        cache.commit(CONTEXT, [])
        if run and time.perf_counter() - started > POINT_SECONDS:
            break
    return statistics.median(spent)
