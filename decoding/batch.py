"""Batched lookahead: one forward pass per iteration over every running stream (continuous batching).

Contract: ``BatchEngine`` is the continuous batch behind one interface: ``add(request_id, prompt_ids, stop,
sampling, lookahead)`` starts a decode (validated first: typed errors, nothing added), ``step()`` advances
every running decode in one packed forward and returns ``(request_id, Step | exception)`` for each decode that
took part, ``cancel(request_id)`` ends one early; a decode whose step carried a finish reason or raised leaves
the batch by itself, and its cache is freed at once. ``add_documents(documents)`` adds token runs (a corpus) to
the shared n-gram memory between steps and ``memory_usage()`` reports it (both None without a memory). With
``BatchPolicy.prefix_cache_tokens`` > 0 the engine keeps a ``decoding.step.prefix_cache.PrefixCache``: ``add`` starts a
decode from the longest prefix of its prompt whose KV a finished decode left there or a running decode's prefilled
prompt holds (unless ``cache_prompt`` is False, or the decode reads prompt logprobs), and a decode that completes
leaves its KV there (unless it opted out); ``prefix_cache_stats()`` reports it (None when off). Only the
thread that owns the device calls ``add``, ``step``, ``cancel`` and those; ``validate`` (the same checks
``add`` runs) may be called from any thread.

Underneath, ``step_batch(streams, policy)`` advances each ``DecodeStream`` by one step and returns, in order,
its ``Step`` or the exception that ended it. All streams share one forward (``forward_batch``: the static step's
bucket when one fits, else the packed eager forward; ``decoding.forward`` maps the order): each keeps its own cache,
window, pool, W/N/G and sampling state, and accepts its own number of tokens, so streams join and leave between calls
and none waits for another. An exception raised by one stream's planning or verification ends that stream only; a
failed forward ends the streams in it.

The step's token budget is shared (``allocate``): every decoding stream gets its one token, prompts are
prefilled in chunks of at most ``prefill_chunk`` tokens per forward (so a long prompt cannot stall running
streams for long), and the remaining budget buys lookahead where the measured step-cost curve says it pays:
a stream's window and candidates are granted when the tokens it expects to gain raise the batch's tokens per
unit of step cost. A lone stream gets whatever its own step policy asks for. Greedy output does not depend on
the budgets.

With a ``decoding.payoff.PayoffGuard`` (``step_batch``'s ``guard``; a ``BatchEngine`` keeps the one ``payoff_guard``
gives its policy: on with a static step or a measured curve, both presets' policies) each lookahead stream's steps
are checked against what they pay: a stream whose recent verifying steps commit fewer tokens than plain one-token
steps would at their price rests, its budget 1 for a while (``decoding.payoff``). A resting stream is not asked to
propose (drafting is host work a plain step does not need): its ``plan(1)`` is a plain one-token step whatever it
proposed last. With ``measure_step_cost`` the engine also times each step a stream took alone, and the guard prices
steps on those wall times (host work included) once it has them.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from decoding.errors import InvalidParameterError
from decoding.forward.packed import forward_packed
from decoding.forward.slices import Slice
from decoding.forward.static import CAPTURED, TOKEN_BUCKETS, StaticStats, StaticStep, bucket_shape
from decoding.grammar import GrammarCompiler
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.payoff import PayoffGuard, WallCurve
from decoding.step.prefix_cache import PrefixCache, PrefixCacheStats, Running
from decoding.step.stream import DecodeStream, Proposal, Step, validate_request

if TYPE_CHECKING:
    from decoding.proposers.ngram_memory import MemoryUsage, NGramMemory

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
    - ``payoff_guard``: whether the engine keeps a payoff guard where it would (``payoff_guard``); False: never.
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
        points = self.step_cost
        xs = [x for x, _ in points]
        index = min(max(bisect.bisect_left(xs, tokens), 1), len(points) - 1)
        (x0, y0), (x1, y1) = points[index - 1], points[index]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

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


def payoff_guard(policy: BatchPolicy) -> PayoffGuard | None:
    """The payoff guard of an engine under ``policy`` (``decoding.payoff``): on with a static step or a measured
    curve, which both presets' policies have (CUDA: a wide window runs every step, priced by no gate; CPU: the lazy
    window and ``break_even`` gate each verifying step on its expected gain, the guard checks what it realised), off
    otherwise or with ``policy.payoff_guard`` false; with ``measure_step_cost``, its price is measured online too
    (``WallCurve``), bucketed as the static step pads a lone stream (without one, by powers of two).

    >>> payoff_guard(BatchPolicy()) is None, payoff_guard(BatchPolicy(static_step="graphs")).wall is None
    (True, True)
    >>> payoff_guard(BatchPolicy(static_step="graphs", payoff_guard=False)) is None
    True
    >>> guard = payoff_guard(BatchPolicy(static_step="graphs", measure_step_cost=True))
    >>> guard.wall is not None, guard.bucket(300), payoff_guard(BatchPolicy(measure_step_cost=True)).bucket(300)
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


def step_batch(
    streams: Sequence[DecodeStream], policy: BatchPolicy, static: StaticStep | None = None,
    guard: PayoffGuard | None = None,
) -> list[Step | BaseException | None]:
    """Advance the (unfinished) streams by one step in one packed forward; see the module contract. With
    ``static``, a step whose slices fit one of its buckets runs there (``decoding.forward.static``), else eagerly.
    With ``guard``, a stream it rests takes a plain one-token step, and each step taken is recorded in it (keyed by
    the stream).

    Each result is the stream's ``Step``, the exception that ended it, or None when the stream sat this
    forward out (a prompt waiting for its prefill chunk).
    """
    results: list[Step | BaseException | None] = [None] * len(streams)
    planned, slices = plan_batch(streams, policy, results, guard)
    if planned:
        _forward_and_finish(streams, planned, slices, results, static)
    if guard is not None:
        for stream, result in zip(streams, results, strict=True):
            if isinstance(result, Step):
                guard.record(stream, result.stats)
    return results


def plan_batch(
    streams: Sequence[DecodeStream], policy: BatchPolicy, results: list[Step | BaseException | None],
    guard: PayoffGuard | None = None,
) -> tuple[list[int], list[Slice]]:
    """Propose, allocate and plan one step of ``streams``: the indices that run and their slices, in order. A
    stream whose proposal or plan raised gets its exception in ``results`` and does not run. A stream ``guard``
    rests proposes nothing and gets one token (module contract)."""
    proposals: dict[int, Proposal] = {}
    for index, stream in enumerate(streams):
        if guard is not None and guard.resting(stream):
            proposals[index] = Proposal(1)
            continue
        try:
            proposals[index] = stream.propose(policy.stream_cost)
        except Exception as error:  # one stream's failure ends that stream only
            results[index] = error
    order = list(proposals)
    budgets = allocate([proposals[index] for index in order], policy)
    planned, slices = [], []
    for index, budget in zip(order, budgets, strict=True):
        if budget == 0:
            continue
        try:
            slices.append(streams[index].plan(budget))
            planned.append(index)
        except Exception as error:
            results[index] = error
    return planned, slices


def forward_batch(
    model: PreTrainedModel, slices: Sequence[Slice], static: StaticStep | None = None
) -> tuple[list[torch.Tensor], list[list[int]] | list[None]]:
    """One forward over ``slices``: each slice's logits, and their rows' argmax ids when the static step ran it
    (``static`` given and a bucket fits; None per slice after an eager forward)."""
    with _inference():
        bucket = static.bucket(slices) if static is not None else None
        if bucket is not None:
            return static.run(slices, bucket)
        if static is not None:
            static.eager += 1
        return forward_packed(model, slices), [None] * len(slices)


def _forward_and_finish(
    streams: Sequence[DecodeStream], planned: list[int], slices: list, results: list[Step | BaseException | None],
    static: StaticStep | None = None,
) -> None:
    """Run one forward over ``slices`` and hand each planned stream its logits."""
    try:
        logits, argmax = forward_batch(streams[planned[0]].model, slices, static)
    except Exception as error:  # the forward failed: every stream in it ends
        for index in planned:
            results[index] = error
        return
    finish_batch(streams, planned, logits, argmax, results)


def finish_batch(
    streams: Sequence[DecodeStream], planned: list[int], logits: Sequence[torch.Tensor],
    argmax: Sequence[list[int] | None], results: list[Step | BaseException | None],
) -> None:
    """Hand each planned stream its logits (and argmax ids); its ``Step`` or exception goes to ``results``."""
    for index, stream_logits, stream_argmax in zip(planned, logits, argmax, strict=True):
        try:
            with _inference():
                results[index] = streams[index].finish(stream_logits, stream_argmax)
        except Exception as error:
            results[index] = error


def _inference() -> contextlib.AbstractContextManager:
    """``torch.inference_mode()``, or nothing to enter where it is on already (the engine's thread steps in it)."""
    return contextlib.nullcontext() if torch.is_inference_mode_enabled() else torch.inference_mode()


# (model, prompt_ids, stop, sampling, lookahead, memory, prediction) -> a new decode
OpenStream = Callable[..., DecodeStream]


class BatchEngine:
    """The running decodes of one model, keyed by the caller's request ids, stepped together (module contract).

    ``open_stream`` builds each decode's ``DecodeStream`` (``DecodeStream`` itself unless a test injects a
    variant); ``memory``, the server-wide n-gram memory shared by its lookahead decodes (None: off), and with it a
    recycled-logits table they share (``successors``, ``decoding.proposers.recycled``); ``grammars``
    compiles the constraint of a decode whose ``SamplingParams.grammar`` is set (None: such decodes are refused).
    Not thread-safe: one thread owns the device and calls ``add``, ``step`` and ``cancel``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        policy: BatchPolicy = BatchPolicy(),
        open_stream: OpenStream = DecodeStream,
        memory: NGramMemory | None = None,
        grammars: GrammarCompiler | None = None,
        static: StaticStep | None = None,
        guard: Callable[[BatchPolicy], PayoffGuard | None] = payoff_guard,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        self.static = static
        self.grammars = grammars
        self.policy = policy
        self.memory = memory
        # the recycled-logits table its lookahead decodes share: it goes with the shared memory (off with it)
        self.successors: dict[int, tuple[int, ...]] | None = {} if memory is not None else None
        self._open_stream = open_stream
        self._streams: dict[Hashable, DecodeStream] = {}
        self.prefix_cache = PrefixCache(policy.prefix_cache_tokens) if policy.prefix_cache_tokens > 0 else None
        self._uncached: set[Hashable] = set()  # running decodes that opted out of the prefix cache
        self.last_forward: str | None = None  # how the last step's forward ran: "graph", "static" or "eager"
        self.guard = guard(policy)
        self._clock = clock

    @property
    def has_work(self) -> bool:
        """True while any decode is running."""
        return bool(self._streams)

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._streams

    def validate(
        self,
        prompt_ids: Sequence[int],
        stop: StopCriteria,
        sampling: SamplingParams = SamplingParams(),
        lookahead: LookaheadConfig | None = None,
    ) -> None:
        """Raise ``InvalidParameterError`` (naming the parameter) if ``add`` would refuse these arguments."""
        validate_request(self.model, prompt_ids, stop, sampling, lookahead)

    def add(
        self,
        request_id: Hashable,
        prompt_ids: Sequence[int],
        stop: StopCriteria,
        sampling: SamplingParams = SamplingParams(),
        lookahead: LookaheadConfig | None = None,
        prediction: Sequence[int] | None = None,
        cache_prompt: bool = True,
    ) -> None:
        """Start decoding ``prompt_ids``; its prefill runs in the next ``step``. Raises ``InvalidParameterError``
        on bad arguments and ``ValueError`` on a request id already running, adding nothing. ``prediction``
        (token ids of the expected output) seeds a lookahead decode's copies (see ``DecodeStream``).
        ``cache_prompt`` False keeps the decode out of the prefix cache: it neither starts from it nor leaves its
        KV there."""
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already running")
        extra = {}
        if self.prefix_cache is not None and cache_prompt and sampling.prompt_logprobs is None:
            validate_request(self.model, prompt_ids, stop, sampling, lookahead)  # no lookup for a refused request
            hit = self.prefix_cache.lookup(prompt_ids, self._running_prompts())
            if hit is not None:
                extra["prefix"] = hit
        if sampling.grammar is not None:
            if self.grammars is None:
                raise InvalidParameterError("grammar", "this engine has no grammar compiler")
            extra["constraint"] = self.grammars.constraint(sampling.grammar)
        if self.static is not None:
            extra["pool"] = self.static.pool
        if self.successors is not None:
            extra["successors"] = self.successors
        self._streams[request_id] = self._open_stream(
            self.model, prompt_ids, stop, sampling, lookahead, self.memory, prediction, **extra
        )
        if not cache_prompt:
            self._uncached.add(request_id)

    def _running_prompts(self) -> list[Running]:
        """The running decodes' prompts as prefix sources: their ids and the prompt slots already prefilled."""
        sources = []
        for request_id, stream in self._streams.items():
            sequence = stream.sequence
            if request_id in self._uncached or sequence.cache is None:
                continue
            sources.append((sequence.tokens, sequence.cache, min(sequence.cache.length, sequence.prompt_length)))
        return sources

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's contents and counters (``decoding.step.prefix_cache.PrefixCacheStats``); None when off."""
        return None if self.prefix_cache is None else self.prefix_cache.stats()

    def step(self) -> list[tuple[Hashable, Step | BaseException]]:
        """One packed forward over every running decode: each participant's ``Step`` or the exception that
        ended it, in the order they were added. A decode waiting for its prefill chunk is left out; a
        finished or failed one leaves the batch."""
        request_ids = list(self._streams)
        runs = self.static.runs if self.static is not None else 0
        started = self._clock()
        results = step_batch([self._streams[request_id] for request_id in request_ids], self.policy, self.static,
                             self.guard)
        seconds = self._clock() - started
        self.last_forward = "eager"
        if self.static is not None and self.static.runs > runs:
            self.last_forward = "graph" if self.static.mode in CAPTURED else "static"
        reported: list[tuple[Hashable, Step | BaseException]] = []
        for request_id, result in zip(request_ids, results, strict=True):
            if result is None:
                continue
            reported.append((request_id, result))
            if isinstance(result, BaseException) or result.finish_reason is not None:
                self.cancel(request_id)
        if self.guard is not None and len(reported) == 1 and isinstance(reported[0][1], Step):
            self.guard.observe(reported[0][1].stats, seconds)  # a lone decode's step: its wall is its own
        return reported

    def static_stats(self) -> StaticStats | None:
        """The static step's buckets and captures so far (``decoding.forward.static.StaticStats``); None without one."""
        return None if self.static is None else self.static.stats()

    def add_documents(self, documents: Sequence[Sequence[int]]) -> MemoryUsage | None:
        """Store each token run of ``documents`` as one document of the shared memory (its bound holds: the oldest
        documents are evicted); the memory's usage after, or None (nothing stored) when the engine has none. Call
        it between steps, on the thread that steps the engine."""
        return None if self.memory is None else self.memory.add_documents(documents)

    def memory_usage(self) -> MemoryUsage | None:
        """The shared memory's tokens, documents and capacity; None when the engine has none."""
        return None if self.memory is None else self.memory.usage()

    def cancel(self, request_id: Hashable) -> None:
        """End ``request_id``'s decode and free its cache (a completed decode first leaves its KV in the prefix
        cache); a no-op for an unknown or finished request."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        if self.guard is not None:
            self.guard.forget(stream)
        opted_out = request_id in self._uncached
        self._uncached.discard(request_id)
        state = stream.prefix_state() if self.prefix_cache is not None and not opted_out else None
        try:
            if state is not None:
                self.prefix_cache.store(state[0], stream.sequence.cache, state[1])
        finally:
            stream.close()
