"""Batched lookahead: one forward pass per iteration over every running stream (continuous batching).

Contract: ``BatchEngine`` is the continuous batch behind one interface: ``add(request_id, prompt_ids, stop,
sampling, lookahead)`` starts a decode (validated first: typed errors, nothing added), ``step()`` advances
every running decode in one packed forward and returns ``(request_id, Step | exception)`` for each decode that
took part, ``cancel(request_id)`` ends one early; a decode whose step carried a finish reason or raised leaves
the batch by itself, and its cache is freed at once. ``launch()`` and ``complete(launched)`` are ``step``'s two halves
(the step planned and its forward started; then read and finished), so that the caller's own work runs while the
device does (``asynchronous``: on a GPU; on a CPU the forward runs inside ``launch``); nothing else may be called
between them. ``add_documents(documents)`` adds token runs (a corpus) to
the shared n-gram memory between steps and ``memory_usage()`` reports it (both None without a memory). With
``BatchPolicy.prefix_cache_tokens`` > 0 the engine keeps a ``decoding.step.prefix_cache.PrefixCache``: ``add`` starts a
decode from the longest prefix of its prompt whose KV a finished decode left there or a running decode's prefilled
prompt holds (unless ``cache_prompt`` is False, or the decode reads prompt logprobs), and a decode that completes
leaves its KV there (unless it opted out); ``prefix_cache_stats()`` reports it (None when off). Only the
thread that owns the device calls ``add``, ``step``, ``cancel`` and those; ``validate`` (the same checks
``add`` runs) may be called from any thread.

Underneath, ``step_batch(streams, policy)`` (``complete_batch(launch_batch(...))``) advances each ``DecodeStream`` by
one step and returns, in order, its ``Step`` or the exception that ended it. All streams share one forward
(``start_forward``: the static step's bucket when one fits, else the packed eager forward; ``decoding.forward`` maps
the order): each keeps its own cache, window, pool, W/N/G and sampling state, and accepts its own number of tokens, so
streams join and leave between calls and none waits for another. An exception raised by one stream's planning or
verification ends that stream only; a failed forward ends the streams in it.

The step's token budget is shared (``decoding.batch_policy.allocate``): every decoding stream gets its one token,
prompts are prefilled in chunks of at most ``prefill_chunk`` tokens per forward (so a long prompt cannot stall
running streams for long), and the remaining budget buys lookahead where the measured step-cost curve says it pays:
a stream's window and candidates are granted when the tokens it expects to gain raise the batch's tokens per
unit of step cost. A lone stream gets whatever its own step policy asks for. Greedy output does not depend on
the budgets.

With a ``decoding.payoff.PayoffGuard`` (``step_batch``'s ``guard``; a ``BatchEngine`` keeps the one ``engine_guard``
gives its policy: on with a static step or a measured curve, both presets' policies) each lookahead stream's steps
are checked against what they pay: a stream whose recent verifying steps commit fewer tokens than plain one-token
steps would at their price rests, its budget 1 for a while (``decoding.payoff``). A resting stream is not asked to
propose (drafting is host work a plain step does not need): its ``plan(1)`` is a plain one-token step whatever it
proposed last. With ``measure_step_cost`` the engine also times each step a stream took alone, and the guard prices
steps on those wall times (host work included) once it has them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from decoding.batch_policy import CPU_STEP_COST, BatchPolicy, allocate, engine_guard  # noqa: F401 (re-exported)
from decoding.errors import InvalidParameterError
from decoding.forward.packed import forward_packed
from decoding.forward.slices import Slice
from decoding.forward.static import CAPTURED, StaticStats, StaticStep
from decoding.grammar import GrammarCompiler
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.payoff import PayoffGuard
from decoding.step.prefix_cache import PrefixCache, PrefixCacheStats, Running
from decoding.step.stream import DecodeStream, Proposal, Step, validate_request

if TYPE_CHECKING:
    from decoding.proposers.ngram_memory import MemoryUsage, NGramMemory


def step_batch(
    streams: Sequence[DecodeStream], policy: BatchPolicy, static: StaticStep | None = None,
    guard: PayoffGuard | None = None,
) -> list[Step | BaseException | None]:
    """Advance the (unfinished) streams by one step in one packed forward; see the module contract. With
    ``static``, a step whose slices fit one of its buckets runs there (``decoding.forward.static``), else eagerly.
    With ``guard``, a stream it rests takes a plain one-token step, and each step taken is recorded in it (keyed by
    the stream).

    Each result is the stream's ``Step``, the exception that ended it, or None when the stream sat this
    forward out (a prompt waiting for its prefill chunk). ``complete_batch(launch_batch(...))``.
    """
    return complete_batch(launch_batch(streams, policy, static, guard), guard)


@dataclass
class InFlight:
    """One step of a batch between ``launch_batch`` and ``complete_batch``: its streams, their results so far (a
    stream whose planning failed has its exception), the indices planned into the forward with their slices, and
    ``collect``, which reads the forward's results (None when nothing runs or the forward failed to start)."""

    streams: Sequence[DecodeStream]
    results: list[Step | BaseException | None]
    planned: list[int]
    slices: list[Slice]
    collect: Callable[[], tuple[Sequence[torch.Tensor], Sequence[Sequence[int] | None]]] | None = None


def launch_batch(
    streams: Sequence[DecodeStream], policy: BatchPolicy, static: StaticStep | None = None,
    guard: PayoffGuard | None = None,
) -> InFlight:
    """The first half of ``step_batch``: plan the step and start its forward (``start_forward``: on a GPU the
    forward is queued and this returns while the device runs it). Nothing may touch the streams until
    ``complete_batch`` has read the step."""
    results: list[Step | BaseException | None] = [None] * len(streams)
    planned, slices = plan_batch(streams, policy, results, guard)
    flight = InFlight(streams, results, planned, slices)
    if planned:
        try:
            flight.collect = start_forward(streams[planned[0]].model, slices, static)
        except Exception as error:  # the forward failed: every stream in it ends
            for index in planned:
                results[index] = error
    return flight


def complete_batch(flight: InFlight, guard: PayoffGuard | None = None) -> list[Step | BaseException | None]:
    """The second half of ``step_batch``: read the launched forward (waiting for the device), hand each planned
    stream its logits, record each step taken in ``guard``; the results, as ``step_batch``'s."""
    if flight.collect is not None:
        try:
            logits, argmax = flight.collect()
        except Exception as error:  # the forward failed: every stream in it ends
            for index in flight.planned:
                flight.results[index] = error
        else:
            finish_batch(flight.streams, flight.planned, logits, argmax, flight.results)
        flight.collect = None
    if guard is not None:
        for stream, result in zip(flight.streams, flight.results, strict=True):
            if isinstance(result, Step):
                guard.record(stream, result.stats)
    return flight.results


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
    (``static`` given and a bucket fits; None per slice after an eager forward). ``start_forward(...)()``."""
    return start_forward(model, slices, static)()


def start_forward(
    model: PreTrainedModel, slices: Sequence[Slice], static: StaticStep | None = None
) -> Callable[[], tuple[list[torch.Tensor], list[list[int]] | list[None]]]:
    """Start one forward over ``slices`` and return the call that reads it (``forward_batch``'s results). Through
    the static step (``static`` given and a bucket fits) its inputs are copied and its forward launched here, and
    the read waits for the device (on a GPU, this returns while the device works; the read is the step's one
    device-to-host copy); an eager forward runs here whole."""
    with _inference():
        bucket = static.bucket(slices) if static is not None else None
        if bucket is not None:
            outputs = static.launch(static.prepare(slices, bucket))

            def read() -> tuple[list[torch.Tensor], list[list[int]]]:
                with _inference():
                    return static.collect(slices, *outputs)

            return read
        if static is not None:
            static.eager += 1
        logits = forward_packed(model, slices)
    return lambda: (logits, [None] * len(slices))


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


@dataclass(frozen=True)
class Launched:
    """A ``BatchEngine`` step between ``launch`` and ``complete``: the request ids it stepped, in order, the batch in
    flight, when it started and the static step's run count before it."""

    request_ids: list[Hashable]
    flight: InFlight
    started: float
    runs: int


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
        guard: Callable[[BatchPolicy], PayoffGuard | None] = engine_guard,
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
        self._flight: Launched | None = None  # the step between ``launch`` and ``complete``

    @property
    def asynchronous(self) -> bool:
        """Whether the device runs a launched step while the host goes on (CUDA), so that work between ``launch``
        and ``complete`` is hidden behind the device's."""
        return self.model.device.type == "cuda"

    def _not_in_flight(self, what: str) -> None:
        if self._flight is not None:
            raise RuntimeError(f"{what}() while a step is in flight: complete() it first")

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
        self._not_in_flight("add")
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
        finished or failed one leaves the batch. ``complete(launch())``."""
        return self.complete(self.launch())

    def launch(self) -> Launched:
        """Plan the next step and start its forward (``launch_batch``): on a GPU this returns while the device
        runs it, so that the caller's own work (the last step's text, metrics, streaming) overlaps it. Until
        ``complete`` reads it, the engine is in flight: ``add``, ``cancel``, ``launch`` and ``step`` raise
        ``RuntimeError``."""
        if self._flight is not None:
            raise RuntimeError("a step is in flight: complete() it first")
        request_ids = list(self._streams)
        runs = self.static.runs if self.static is not None else 0
        started = self._clock()
        flight = launch_batch([self._streams[request_id] for request_id in request_ids], self.policy, self.static,
                              self.guard)
        self._flight = Launched(request_ids, flight, started, runs)
        return self._flight

    def complete(self, launched: Launched) -> list[tuple[Hashable, Step | BaseException]]:
        """Read the step ``launch`` started (waiting for the device) and finish it: ``step``'s results."""
        if launched is not self._flight:
            raise RuntimeError("complete() takes the step in flight")
        self._flight = None
        results = complete_batch(launched.flight, self.guard)
        seconds = self._clock() - launched.started
        self.last_forward = "eager"
        if self.static is not None and self.static.runs > launched.runs:
            self.last_forward = "graph" if self.static.mode in CAPTURED else "static"
        reported: list[tuple[Hashable, Step | BaseException]] = []
        for request_id, result in zip(launched.request_ids, results, strict=True):
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
        self._not_in_flight("cancel")
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
