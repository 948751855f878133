"""The one thread that runs the model: a thin loop around the decoder's continuous batch.

Contract: ``Worker`` owns the device and drives one engine (``server.jobs.EngineLike``: ``decoding.BatchEngine`` in
production; the server's tests plug in a stand-in with the same interface, so they drive the same loop). Jobs
arrive through ``submit_many`` (any thread) and wait in a FIFO until one of ``max_running`` slots is free; the
worker then adds them to the engine (continuous batching: jobs join and leave between iterations). The worker
owns the one registry of requests, waiting and running: admission checks it and queues under one lock
(``submit_many``'s ``limit``: the scheduler's capacity), and the engine is keyed by the ``Job`` objects
themselves, so its results come back as jobs (no second table of ids). Each
iteration: jobs whose cancel flag is set end (``abort``) and leave the engine (freeing their cache), newly
admitted jobs join it, and one ``engine.step()`` advances every running job (one batched forward in
production). Each job's steps become text in its own ``TextStream`` here, on this thread (detokenization and
stop strings never wait on a lock the event loop's encoding holds, see ``server.text``); a stop string ends
the job.
Each step's token logprobs (when the request asked for them) follow its kept tokens into the outputs, and so does
the stop token (EOS) the model ended with, which the counts include (``usage`` too) though its text stays out; the
prompt's logprobs (``SamplingParams.prompt_logprobs``) are gathered over the prefill and ride on the job's
first output.
Work other than jobs that must touch the engine (the shared memory's corpus: ``add_documents``,
``memory_usage``) goes through ``call(function)``: the worker runs ``function(engine)`` on its thread between two
iterations, never during a step, and the returned ``concurrent.futures.Future`` carries its result or exception
(a call pending when the worker stops fails with ``WorkerStopped``).
Overlapped steps (``overlap``; by default where the engine is ``asynchronous``: a GPU's): each iteration launches the
engine's step (``launch``: planned, its forward queued on the device), delivers the previous step's results while
the device runs it (text, metrics, each job's output: host work a serial loop adds to every step), then reads it
(``complete``) and keeps its results for the next iteration, or for the iteration after the engine's last step. Nothing
touches the engine while a step is in flight: a job that a delivery finishes (a stop string) leaves the engine once
the step is read, its extra step's tokens dropped. A job's tokens reach its client one step later than serially, which
on a GPU is the plan and launch of a step (well under a millisecond), and on a CPU, whose forward runs inside
``launch``, a whole step: there steps overlap only when asked.
Counts flow as one ``decoding.StepCounts`` record per step into the job's totals, its outputs and the metrics.
Each job reports through its own ``post`` callable: ``Output`` items, the last one carrying ``finish_reason``
and a ``Summary``, or one exception that ends it. An exception reported for one job ends that job only (a
failed batched forward ends the jobs in it); an exception from ``step`` itself ends every running job. Greedy
output does not depend on what else runs: every job has its own cache, window and pool, and the engine's shared
n-gram memory of earlier completions only proposes guesses (it can change a job's speed, never its text).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from decoding import (
    Step,
    StepCounts,
    release_free_memory,
)
from decoding.forward.static import StaticStats
from server.jobs import EngineLike, Job
from server.metrics import Metrics
from server.plans import Output

logger = logging.getLogger("server.worker")


class RequestCancelled(Exception):
    """The request was cancelled (client disconnect) before it finished."""


class GenerationEnded(RuntimeError):
    """The engine dropped a request without reporting a finish reason or an error (an engine bug)."""


class WorkerStopped(RuntimeError):
    """A ``Worker.call`` that never ran: the worker stopped (or had no engine) first."""


Result = TypeVar("Result")


class Worker:
    """The decode thread, its two queues (waiting FIFO, running list) and the engine it drives.

    The engine comes with the constructor or, once the model is loaded, with ``attach`` (before any job).
    """

    def __init__(
        self,
        max_running: int,
        metrics: Metrics | None = None,
        thread_setup: Callable[[], None] | None = None,
        engine: EngineLike | None = None,
        overlap: bool | None = None,
    ) -> None:
        self.max_running = max_running
        self.overlap = overlap  # None: overlap where the engine is asynchronous (``attach``)
        self.overlapping = False
        self._pending: list[tuple[Job, Step | BaseException]] = []  # the last step's results, not yet delivered
        self._in_flight = False  # between the engine's ``launch`` and ``complete``
        self._cancel_after: list[Job] = []  # jobs finished while a step was in flight: out of the engine after it
        self.metrics = metrics
        self.engine = engine
        self._thread_setup = thread_setup
        self._condition = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._calls: deque[tuple[Callable[[EngineLike], Any], Future]] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        if engine is not None:
            self.attach(engine)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Jobs holding a running slot and not finished."""
        return sum(1 for job in self._running if not job.done)

    @property
    def kv_tokens(self) -> int:
        """Tokens the started, unfinished jobs hold in their caches: prompt plus completion so far."""
        return sum(len(job.plan.prompt_ids) + job.totals.tokens for job in self._running
                   if job.started is not None and not job.done)

    @property
    def alive(self) -> bool:
        """False once the thread has died or been stopped after starting (a liveness probe restarts the process)."""
        if self._stopping:
            return False
        return self._thread is None or self._thread.is_alive()

    @property
    def busy(self) -> bool:
        """True while any job is waiting or running."""
        return bool(self._waiting) or self.running > 0

    def attach(self, engine: EngineLike) -> None:
        """Drive ``engine`` from now on (call before submitting jobs). Steps overlap (module contract) when
        ``overlap`` says so, or, with ``overlap`` None, when the engine is asynchronous; only an engine with
        ``launch`` and ``complete`` overlaps."""
        self.engine = engine
        overlap = bool(getattr(engine, "asynchronous", False)) if self.overlap is None else self.overlap
        self.overlapping = overlap and hasattr(engine, "launch") and hasattr(engine, "complete")

    def publish_static(self) -> StaticStats | None:
        """The engine's static-step stats (``decoding.forward.static.StaticStats``) into the metrics, when it has a
        static step and there are metrics; returned either way (None without one)."""
        static = getattr(self.engine, "static_stats", None)  # engines without a static step have none
        stats = static() if static is not None else None
        if stats is not None and self.metrics is not None:
            self.metrics.set_static(stats)
        return stats

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="decode-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every job and end the thread (its current step finishes first)."""
        self.cancel_all(RequestCancelled("the server is stopping"))
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> None:
        """Queue a job; it starts when a running slot is free."""
        self.submit_many([job])

    def submit_many(self, jobs: Sequence[Job], limit: int | None = None) -> bool:
        """Queue ``jobs`` all or none: False (nothing queued) when the running and waiting jobs plus these would
        pass ``limit`` (None: no limit). The check and the queueing are one step under the registry's lock."""
        with self._condition:
            if limit is not None and self.running + len(self._waiting) + len(jobs) > limit:
                return False
            self._waiting.extend(jobs)
            self._publish_queue()
            self._condition.notify_all()
        return True

    def call(self, function: Callable[[EngineLike], Result]) -> Future[Result]:
        """Run ``function(engine)`` on the worker thread between two iterations (any thread may call this); the
        future holds its result or exception. It fails with ``WorkerStopped`` (``function`` not run) when the
        worker is stopping, its thread has died, or it has no engine."""
        future: Future[Result] = Future()
        with self._condition:
            if self.alive and self._thread is not None and self.engine is not None:
                self._calls.append((function, future))
                self._condition.notify_all()
                return future
        future.set_exception(WorkerStopped("the decode worker is not running"))
        return future

    def cancel(self, job: Job, error: BaseException | None = None) -> None:
        """Cancel ``job``: at once if it is still waiting, else before its next step."""
        with self._condition:
            job.cancel_requested = True
            job.cancel_error = error
            if job not in self._waiting:
                return
            self._waiting.remove(job)
            self._publish_queue()
        self._finish(job, "abort", error=error or RequestCancelled("cancelled"))

    def cancel_all(self, error: BaseException) -> None:
        """Cancel every waiting and running job, each ending with ``error``."""
        with self._condition:
            jobs = list(self._waiting) + list(self._running)
        for job in jobs:
            self.cancel(job, error)

    def _leave_engine(self, job: Job) -> None:
        """Take ``job`` out of the engine (freeing its cache); a failure is logged, never raised."""
        try:
            self.engine.cancel(job)
        except Exception:
            logger.exception("removing a request from the engine failed")

    def _publish_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(self.running, len(self._waiting))
            self.metrics.set_kv_tokens(self.kv_tokens)

    def _run(self) -> None:
        if self._thread_setup is not None:
            self._thread_setup()
        while True:
            with self._condition:
                while not self._stopping and not self._waiting and not self._running and not self._calls:
                    self._condition.wait()
                if self._stopping:
                    break
                calls, self._calls = self._calls, deque()
                self._admit()
                jobs = list(self._running)
            self._run_calls(calls)
            self._iterate(jobs)
            with self._condition:
                self._running = [job for job in self._running if not job.done]
                self._publish_queue()
                idle = not self._running and not self._waiting
            if idle:
                release_free_memory()  # a burst's freed buffers go back to the OS while nothing runs
        for job in list(self._running):
            self._finish(job, "abort", error=job.cancel_error or RequestCancelled("the server is stopping"))
        with self._condition:
            calls, self._calls = self._calls, deque()
        for _, future in calls:
            future.set_exception(WorkerStopped("the decode worker stopped"))

    def _run_calls(self, calls: deque[tuple[Callable[[EngineLike], Any], Future]]) -> None:
        """Run the pending ``call`` functions, in order, each posting its result or exception to its future."""
        for function, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(self.engine))
            except Exception as error:  # the caller's to handle, never the worker's
                future.set_exception(error)

    def _admit(self) -> None:
        """Move waiting jobs into free running slots (caller holds the lock)."""
        if self._waiting and len(self._running) < self.max_running:
            while self._waiting and len(self._running) < self.max_running:
                self._running.append(self._waiting.popleft())
            self._publish_queue()

    def _iterate(self, jobs: list[Job]) -> None:
        """End cancelled jobs, add new ones to the engine, then one engine step for all of them (or, once the
        engine has nothing left to run, deliver the last overlapped step)."""
        for job in jobs:
            if job.cancel_requested:
                self._finish(job, "abort", error=job.cancel_error or RequestCancelled("cancelled"))
            elif job.started is None:
                self._begin(job)
        running = [job for job in jobs if not job.done]
        if not running or self.engine is None:
            self._pending = []
            return
        if self.engine.has_work:
            self._step(running)
        else:
            self._deliver_pending()
        pending = {job for job, _ in self._pending}
        for job in running:
            if not job.done and job not in self.engine and job not in pending:
                self._finish(job, "error", error=GenerationEnded("the engine dropped a request without a finish"))

    def _begin(self, job: Job) -> None:
        """Count the job as started and add it to the engine (its prefill runs in the next step)."""
        job.started = job.last_step = time.perf_counter()
        if job.metrics is not None:
            job.metrics.request_started(len(job.plan.prompt_ids), job.started - job.arrived)
        plan = job.plan
        try:
            self.engine.add(job, plan.prompt_ids, plan.stop, plan.sampling, plan.lookahead, plan.prediction,
                            cache_prompt=plan.cache_prompt)
        except Exception as exc:
            logger.exception("generation failed")
            self._finish(job, "error", error=exc)

    def _step(self, jobs: list[Job]) -> None:
        """One engine step; each job consumes its own step or ends with its own error. Overlapping, the step is
        launched first, the previous step's results are delivered while the device runs it, and its own results
        wait for the next step (or for ``_iterate``, when nothing is left to run)."""
        if not self.overlapping:
            results = self._engine_call(jobs, self.engine.step)
            if results is not None:
                self._record(results)
                self._deliver(results)
            return
        launched = self._engine_call(jobs, self.engine.launch)
        if launched is None:
            return
        self._in_flight = True
        try:
            self._deliver_pending()  # the last step's text, metrics and streams, behind this step's device work
            results = self._engine_call(jobs, lambda: self.engine.complete(launched))
        finally:
            self._in_flight = False
            cancels, self._cancel_after = self._cancel_after, []
            for job in cancels:
                self._leave_engine(job)
        if results is not None:
            self._pending = results

    def _engine_call(self, jobs: list[Job], call: Callable[[], Result]) -> Result | None:
        """``call()`` (a step of the engine's), or None when it raised: the engine itself failed, so every job in
        it ends (their undelivered results with them)."""
        try:
            return call()
        except Exception as exc:
            logger.exception("generation failed")
            self._pending = []
            for job in jobs:
                self._finish(job, "error", error=exc)
            return None

    def _record(self, results: list[tuple[Job, Step | BaseException]]) -> None:
        """Count the engine's last completed step (``results``: its forward, run as the engine's ``last_forward``
        says, which only ``complete`` sets, so it still names that step while the next is in flight), the static
        step's and the prefix cache's state (read, never changed: harmless in flight) in the metrics."""
        if self.metrics is None:
            return
        stepped = [result for _, result in results if isinstance(result, Step)]
        if stepped:
            path = getattr(self.engine, "last_forward", None) or "eager"  # engines without a static step: eager
            self.metrics.forward(len(stepped), sum(step.stats.input_tokens for step in stepped), path)
            self.publish_static()
        prefix = getattr(self.engine, "prefix_cache_stats", None)  # engines without a prefix cache have none
        stats = prefix() if prefix is not None else None
        if stats is not None:
            self.metrics.set_prefix_cache(stats)

    def _deliver_pending(self) -> None:
        """Record and deliver the last overlapped step's results, if any."""
        pending, self._pending = self._pending, []
        if pending:
            self._record(pending)
            self._deliver(pending)

    def _deliver(self, results: list[tuple[Job, Step | BaseException]]) -> None:
        """Each job consumes its step (text, counts, its output) or ends with its error."""
        for job, result in results:
            if job.done:
                continue
            if isinstance(result, BaseException):
                logger.error("generation failed", exc_info=result)
                self._finish(job, "error", error=result)
                continue
            try:
                self._consume(job, result)
            except Exception as exc:
                logger.exception("generation failed")
                self._finish(job, "error", error=exc)

    def _consume(self, job: Job, step: Step) -> None:
        """Turn one step into text, count it, post it; finish the job on its last step."""
        now = time.perf_counter()
        delta = job.text.feed(step.token_ids)
        finish_reason = "stop" if delta.stopped else step.finish_reason
        counts = step.stats.counts(delta.tokens)
        stop_token = step.stop_token is not None and not delta.stopped  # a stop string ended the text before it
        if stop_token:  # generated, so counted (as vLLM counts EOS), though its text is not the completion's
            counts += StepCounts(tokens=1, steps=0 if counts.steps else 1)
        job.totals += counts
        job.cached_tokens += step.cached_tokens
        if step.logprobs is not None:
            job.pending_logprobs = (job.pending_logprobs or []) + step.logprobs[: delta.tokens + stop_token]
        if step.prompt_logprobs is not None:
            job.prompt_logprobs = (job.prompt_logprobs or []) + step.prompt_logprobs
        if job.metrics is not None:
            job.metrics.step(counts, step.stats.seconds, now - job.last_step, step.stats.prefill)
            if counts.tokens > 0 and not job.first_token_seen:
                job.metrics.first_token(now - job.arrived)
        job.last_step = now
        job.first_token_seen = job.first_token_seen or counts.tokens > 0
        if finish_reason is None:
            if delta.text:
                job.post(job.output(delta.text))
            return
        final = job.output(delta.text + job.text.finish(), finish_reason, job.summary())
        self._finish(job, finish_reason, output=final)

    def _finish(
        self, job: Job, reason: str, output: Output | None = None, error: BaseException | None = None
    ) -> None:
        """End ``job`` once: take it out of the engine (freeing its cache), post its last item, count it.

        Only the worker thread finishes a job the engine holds; ``cancel`` finishes waiting jobs only.
        """
        with self._condition:
            if job.done:
                return
            job.done = True
            self._publish_queue()
        if job.started is not None and self.engine is not None:
            if self._in_flight:
                self._cancel_after.append(job)  # the engine's step holds it: out once the step is read
            else:
                self._leave_engine(job)
        if job.metrics is not None:  # counted before the client can see its response
            job.metrics.request_finished(reason, job.totals, time.perf_counter() - job.arrived)
        job.post(output if output is not None else error or RequestCancelled(reason))
