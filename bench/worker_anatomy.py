"""The server's own work around each engine step: what the worker adds to a step, serially and overlapped.

Contract: ``measure_worker(model, lookahead, policy, static, overlap, decode, prompt, max_tokens)`` runs one request
through the server's ``server.worker.Worker`` (its ``Job``, ``TextStream`` and metrics, the engine ``BatchEngine`` with
``static``) and
returns, per decode step (median over the request's steps after its prefill), in CPU thread milliseconds of the
worker's thread:

- ``worker_ms``: the worker's work outside the engine's calls (``step``, or ``launch`` and ``complete``): the loop,
  the metrics, and the delivery of each step's results (detokenizing, stop strings, the job's output);
- ``delivered_in_flight_ms``: the part of it delivered while a step was in flight (overlapped, ``overlap`` True),
  which a GPU hides behind the device's work;
- ``critical_ms``: ``worker_ms`` less that: what the worker adds to a step's critical path on a GPU.

``worker_rows(model, static, lookahead, policy, prompt, max_tokens)`` measures both loops for a greedy and a lookahead
request, with the default model's tokenizer where it is cached (else token ids as text); ``worker_table(rows)`` is
their markdown. ``python -m bench anatomy`` reports them (``"server"`` in its JSON), on the CPU or on the device.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence

from transformers import PreTrainedModel

from decoding.batch import BatchEngine, BatchPolicy
from decoding.forward.static import StaticStep
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from server.jobs import Job
from server.metrics import Metrics
from server.plans import GenerationPlan
from server.text import TextStream
from server.worker import Worker


class _Timed(Worker):
    """A worker that times its thread's work outside the engine's calls, and its deliveries in flight."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outside: list[float] = []  # per engine step: thread seconds outside the engine's calls
        self.in_flight: list[float] = []  # per engine step: thread seconds delivering while it was in flight
        self._mark: float | None = None
        self._delivered = 0.0

    def timed_engine(self, engine: BatchEngine) -> BatchEngine:
        """Wrap the engine calls this worker's loop makes (``launch`` and ``complete`` overlapped, else ``step``)
        so that the time between them is counted per step."""
        for name in ("launch", "complete") if self.overlapping else ("step",):
            setattr(engine, name, self._around(getattr(engine, name), ends_step=name != "launch"))
        return engine

    def _around(self, call: Callable, ends_step: bool) -> Callable:
        def timed(*args):
            if self._mark is not None:
                self._outside += time.thread_time() - self._mark
            try:
                return call(*args)
            finally:
                if ends_step and self._mark is not None:
                    self.outside.append(self._outside)
                    self.in_flight.append(self._delivered)
                if ends_step or self._mark is None:
                    self._outside, self._delivered = 0.0, 0.0
                self._mark = time.thread_time()
        return timed

    def _deliver_pending(self) -> None:
        started = time.thread_time()
        try:
            super()._deliver_pending()
        finally:
            if self._in_flight:
                self._delivered += time.thread_time() - started


def measure_worker(
    model: PreTrainedModel, lookahead: LookaheadConfig | None, policy: BatchPolicy, static: StaticStep | None,
    overlap: bool, decode: Callable[[Sequence[int]], str], prompt: Sequence[int], max_tokens: int,
) -> dict[str, float]:
    """One request through a ``Worker`` (module contract): its per-step medians. The job posts its outputs to a list
    (the server's post hands each to the event loop: a few microseconds more a step, not counted here)."""
    engine = BatchEngine(model, policy, static=static, guard=lambda policy: None)
    worker = _Timed(1, Metrics(), overlap=overlap)
    worker.attach(engine)
    worker.timed_engine(engine)
    plan = GenerationPlan(list(prompt), StopCriteria(max_tokens, frozenset()), SamplingParams(), lookahead, ())
    outputs: list[object] = []
    done = threading.Event()

    def post(item: object) -> None:
        outputs.append(item)
        if isinstance(item, BaseException) or getattr(item, "finish_reason", None) is not None:
            done.set()

    worker.start()
    try:
        worker.submit(Job(plan, TextStream(decode), post, Metrics()))
        if not done.wait(600):
            raise TimeoutError("the worker did not finish its request")
    finally:
        worker.stop()
    if isinstance(outputs[-1], BaseException):
        raise outputs[-1]
    steps = list(zip(worker.outside, worker.in_flight, strict=True))[2 if worker.overlapping else 1 :]
    outside = [1000 * seconds for seconds, _ in steps]
    delivered = [1000 * seconds for _, seconds in steps]
    return {"worker_ms": round(statistics.median(outside), 3),
            "delivered_in_flight_ms": round(statistics.median(delivered), 3),
            "critical_ms": round(statistics.median(a - b for a, b in zip(outside, delivered, strict=True)), 3),
            "steps": len(steps)}


def worker_rows(model: PreTrainedModel, static: StaticStep | None, lookahead: LookaheadConfig, policy: BatchPolicy,
                prompt: Sequence[int], max_tokens: int) -> dict[str, dict[str, dict[str, float]]]:
    """``measure_worker`` for a greedy and a ``lookahead`` request, each with the worker's loop serial and
    overlapped: ``{stream: {loop: measures}}``."""
    decode = default_decode()
    return {stream: {loop: measure_worker(model, config, policy, static, loop == "overlapped", decode, prompt,
                                          max_tokens) for loop in ("serial", "overlapped")}
            for stream, config in (("greedy", None), ("lookahead", lookahead))}


def worker_table(rows: dict[str, dict[str, dict[str, float]]], title: str) -> list[str]:
    """``worker_rows``' measures as markdown table lines, its first header cell ``title``."""
    lines = [f"| {title} | loop | worker ms a step | delivered in flight | critical ms |", "|---|---|---|---|---|"]
    for stream, loops in rows.items():
        for loop, row in loops.items():
            lines.append(f"| {stream} | {loop} | {row['worker_ms']:.3f} | {row['delivered_in_flight_ms']:.3f} | "
                         f"{row['critical_ms']:.3f} |")
    return lines


def default_decode() -> Callable[[Sequence[int]], str]:
    """The default model's tokenizer's ``decode`` where the model is cached, else token ids as text."""
    try:
        from transformers import AutoTokenizer

        from decoding.weights.loading import DEFAULT_MODEL, cache_root

        directory = cache_root() / "models" / DEFAULT_MODEL.split("/")[-1].removesuffix(".gguf")
        return AutoTokenizer.from_pretrained(directory).decode
    except Exception:
        return lambda ids: "".join(f"<{token}>" for token in ids)
