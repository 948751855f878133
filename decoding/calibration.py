"""The step-cost curve measured where the server runs: what a forward of k input tokens costs against one token.

Contract: ``measure_step_cost(model, static, max_tokens)`` times one stream's forward of k input tokens, causal over
a cache already holding ``CONTEXT`` tokens, through ``decoding.batch.forward_batch``: the path the engine's decode
steps take (the static step's bucket when one fits, replayed as a CUDA graph on CUDA; else the eager forward, the k
tokens carrying a chain's mask as a lookahead tree does: on the CPU the fused step's one native call, not a prompt
chunk's path; the lean step or the public forward elsewhere). The ks are the static step's token buckets up to
``max_tokens`` with a static step, powers of two up to it without. Each time is wall clock around the whole call,
its inputs' preparation and the read of its argmax ids to the host included (that read waits for the device), so it
is what a step pays apart from drafting and verifying. The ks are run in rounds (every k once a round, so a burst of
noise from elsewhere spreads over them instead of bending one point): one untimed round, then timed rounds until
``ROUNDS`` or ``BUDGET_SECONDS`` (at least one); each k's cost is its fastest run (noise only ever adds time). Each
timed step follows an untimed one-token step, as a decode's verifying steps follow its plain ones: a one-token step
right after the ladder's widest ran ~10 % slower on the CPU, which read every wider step ~10 % cheaper than the
decode pays for it.
Returns ``(k, cost(k) / cost(1))`` points, made non-decreasing and at most k (a k-token step never costs more than k
one-token steps: a point above that is noise), ready for ``BatchPolicy.step_cost``. The cache is dropped back to
``CONTEXT`` tokens after every run and freed at the end. On the default model: ~3 s on a CPU at the CPU preset (k <=
128), well under a second on a GPU. ``calibrated(model, policy, static)`` is ``policy`` priced on that curve, the
measurement logged with its time: what the server's engine builder and the bench both run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from decoding.batch import BatchPolicy, forward_batch
from decoding.forward.kv_cache import SlotCache, new_cache
from decoding.forward.slices import Slice
from decoding.forward.static import TOKEN_BUCKETS, StaticStep

log = logging.getLogger(__name__)

CONTEXT = 256  # cached tokens under the timed steps: a conversation's first turn
ROUNDS = 3
BUDGET_SECONDS = 5.0


def measure_step_cost(
    model: PreTrainedModel, static: StaticStep | None, max_tokens: int, rounds: int = ROUNDS,
    budget_seconds: float = BUDGET_SECONDS,
) -> tuple[tuple[int, float], ...]:
    """The measured curve (module contract): ``(tokens, relative cost)`` for each k up to ``max_tokens``."""
    counts = step_counts(max_tokens, static is not None)
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    cache = _cache(model, static, CONTEXT + counts[-1])
    try:
        _fill(model, static, cache, vocab)
        best = {count: float("inf") for count in counts}
        for count in counts:  # the untimed round: every shape built and warm
            _run(model, static, cache, count, vocab)
        started = time.perf_counter()
        for done in range(rounds):
            if done and time.perf_counter() - started > budget_seconds:
                break
            for count in counts:
                _lead_in(model, static, cache, vocab)
                best[count] = min(best[count], _run(model, static, cache, count, vocab))
    finally:
        if cache.pool is not None:
            cache.pool.release(cache)
    curve, highest = [], 0.0
    for count in counts:
        highest = min(max(highest, best[count] / best[1]), float(count))  # never above k one-token steps
        curve.append((count, round(highest, 3)))
    return tuple(curve)


def calibrated(model: PreTrainedModel, policy: BatchPolicy, static: StaticStep | None) -> BatchPolicy:
    """``policy`` with its ``step_cost`` replaced by the curve ``measure_step_cost`` measures here (in inference
    mode, up to ``policy.max_step_tokens``), logged with the time it took."""
    started = time.perf_counter()
    with torch.inference_mode():
        curve = measure_step_cost(model, static, policy.max_step_tokens)
    log.info("step cost measured in %.1f s: %s", time.perf_counter() - started, curve_text(curve))
    return replace(policy, step_cost=curve)


def curve_text(curve: tuple[tuple[int, float], ...]) -> str:
    """A curve as ``1:1, 2:1.25, ...``.

    >>> curve_text(((1, 1.0), (2, 1.25)))
    '1:1, 2:1.25'
    """
    return ", ".join(f"{tokens}:{cost:g}" for tokens, cost in curve)


def step_counts(max_tokens: int, static: bool) -> list[int]:
    """The ks measured: the static step's token buckets up to ``max_tokens`` (``static``), else powers of two;
    always 1 and at least one more.

    >>> step_counts(128, static=False), step_counts(200, static=True)[-3:], step_counts(1, static=False)
    ([1, 2, 4, 8, 16, 32, 64, 128], [96, 128, 192], [1, 2])
    """
    ladder = TOKEN_BUCKETS if static else tuple(2**power for power in range(11))  # 1 .. 1024
    counts = [count for count in ladder if count <= max_tokens]
    return counts if len(counts) > 1 else [1, 2]


def _cache(model: PreTrainedModel, static: StaticStep | None, capacity: int) -> SlotCache:
    """A pool row of the static step when there is one free (the engine's decodes run there), else a cache of
    the model's own."""
    cache = static.pool.acquire(capacity) if static is not None else None
    return cache if cache is not None else new_cache(model, capacity)


def _fill(model: PreTrainedModel, static: StaticStep | None, cache: SlotCache, vocab: int) -> None:
    """Prefill ``CONTEXT`` tokens into ``cache`` (in chunks of at most 128, as the engine's prefill runs)."""
    while cache.length < CONTEXT:
        forward_batch(model, [_slice(cache, min(128, CONTEXT - cache.length), vocab)], static)


def _slice(cache: SlotCache, count: int, vocab: int, tree: bool = False) -> Slice:
    """``count`` causal tokens after ``cache``'s, reading every row (as a lookahead step reads its tree's).
    ``tree``: the causal visibility given as a chain of parents and its mask, as a lookahead step's tree is, so
    that an eager step takes a decode step's path (on the CPU the fused step's one native call) and not a prompt
    chunk's; a static step runs a slice without parents as that same chain already."""
    start = cache.length
    tokens = [(7 * (start + offset) + 1) % vocab for offset in range(count)]  # not all alike
    visible = torch.ones((count, count), dtype=torch.bool).tril() if tree else None
    parents = tuple(range(-1, count - 1)) if tree else None  # a chain: each token's parent the one before it
    return Slice(tokens, None, visible, None, cache, parents=parents, host_positions=range(start, start + count),
                 host_rows=range(count))


def _lead_in(model: PreTrainedModel, static: StaticStep | None, cache: SlotCache, vocab: int) -> None:
    """The untimed one-token step before each timed one (module contract): a decode's steps follow one-token steps."""
    _run(model, static, cache, 1, vocab)


def _run(model: PreTrainedModel, static: StaticStep | None, cache: SlotCache, count: int, vocab: int) -> float:
    """Wall seconds of one ``count``-token step over ``cache`` (module contract); the step is dropped after."""
    begin = time.perf_counter()
    logits, argmax = forward_batch(model, [_slice(cache, count, vocab, tree=static is None)], static)
    if argmax[0] is None:  # the eager forward: the engine reads the argmax ids itself
        torch.argmax(logits[0], dim=-1).tolist()
    spent = time.perf_counter() - begin
    cache.commit(CONTEXT, [])
    return spent
