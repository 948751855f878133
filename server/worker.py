"""The one thread that runs the model: every iteration, one batched step of all running requests.

Contract: ``Worker`` owns the device. Jobs arrive through ``submit`` (any thread) and wait in a FIFO until one
of ``max_running`` slots is free (continuous batching: jobs join and leave between iterations). Every
iteration advances each running job by one step: the jobs whose steps are decoder streams
(``decoding.DecodeStream``) share one forward pass (``decoding.step_batch``, under the ``BatchPolicy``: a
shared token budget, chunked prefill); any other step iterator (a test's scripted decoder) advances on its
own. A job's cancel flag is checked before each of its steps; a cancelled or finished job's steps are
closed at once (freeing its cache). Each job reports through its own ``post`` callable: ``Output`` items,
the last one carrying ``finish_reason`` and a ``Summary``, or one exception that ends it. An exception
inside one job ends that job only (a failed batched forward ends the jobs in it). Greedy output does not
depend on what else runs: every job has its own cache, window and pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from decoding import BatchPolicy, DecodeStream, LookaheadConfig, Step, step_batch
from server.metrics import Metrics, RequestRecord, StepRecord
from server.text import TextStream

logger = logging.getLogger("server.worker")


class RequestCancelled(Exception):
    """The request was cancelled (client disconnect) before it finished."""


class GenerationEnded(RuntimeError):
    """A step generator stopped without reporting a finish reason (a decoder bug)."""


@dataclass(frozen=True)
class Summary:
    """Totals of a finished request: the ``usage`` and ``decoding`` numbers."""

    prompt_tokens: int
    completion_tokens: int
    steps: int  # forward passes that produced at least one kept token, prefill included
    offered: int
    accepted: int
    lookahead: LookaheadConfig | None


@dataclass(frozen=True)
class Output:
    """Text produced by one step; the last output of a request has ``finish_reason`` and ``summary``.

    ``tokens``, ``accepted`` and ``offered`` count what the steps since the previous output committed,
    accepted from guesses and offered for verification: normally one step's, more when a step's text was
    held back (an incomplete character, a possible stop-string prefix, EOS), so they add up to the totals.
    """

    text: str
    finish_reason: str | None = None
    summary: Summary | None = None
    tokens: int = 0
    accepted: int = 0
    offered: int = 0


@dataclass
class Tally:
    """Running totals of one request."""

    completion_tokens: int = 0
    steps: int = 0
    offered: int = 0
    accepted: int = 0

    def add(self, tokens: int, offered: int, accepted: int) -> None:
        self.completion_tokens += tokens
        self.steps += 1 if tokens > 0 else 0
        self.offered += offered
        self.accepted += accepted


@dataclass(eq=False)
class Job:
    """One request as the worker sees it. ``post`` must be safe to call from the worker thread."""

    steps: Iterator[Step]
    text: TextStream
    prompt_tokens: int
    lookahead: LookaheadConfig | None
    post: Callable[[Output | BaseException], None]
    metrics: Metrics | None = None  # None: not counted (the warm-up request)
    arrived: float = field(default_factory=time.perf_counter)
    tally: Tally = field(default_factory=Tally)
    cancel_requested: bool = False
    cancel_error: BaseException | None = None
    started: float | None = None
    last_step: float = 0.0
    first_token_seen: bool = False
    step_count: int = 0
    done: bool = False
    reported: Tally = field(default_factory=Tally)  # the tally as of the last posted output

    def summary(self) -> Summary:
        t = self.tally
        return Summary(self.prompt_tokens, t.completion_tokens, t.steps, t.offered, t.accepted, self.lookahead)

    def output(self, text: str, finish_reason: str | None = None, summary: Summary | None = None) -> Output:
        """An output carrying the counts tallied since the previous one."""
        t, r = self.tally, self.reported
        output = Output(text, finish_reason, summary, t.completion_tokens - r.completion_tokens,
                        t.accepted - r.accepted, t.offered - r.offered)
        self.reported = Tally(t.completion_tokens, t.steps, t.offered, t.accepted)
        return output


class Worker:
    """The decode thread and its two queues (waiting FIFO, running list)."""

    def __init__(
        self,
        max_running: int,
        metrics: Metrics | None = None,
        thread_setup: Callable[[], None] | None = None,
        policy: BatchPolicy | None = None,
    ) -> None:
        self.max_running = max_running
        self.metrics = metrics
        self.policy = policy or BatchPolicy()
        self._thread_setup = thread_setup
        self._condition = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Jobs holding a running slot and not finished."""
        return sum(1 for job in self._running if not job.done)

    @property
    def busy(self) -> bool:
        """True while any job is waiting or running."""
        return bool(self._waiting) or self.running > 0

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
        with self._condition:
            self._waiting.append(job)
            self._publish_queue()
            self._condition.notify_all()

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

    def _publish_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(self.running, len(self._waiting))

    def _run(self) -> None:
        if self._thread_setup is not None:
            self._thread_setup()
        while True:
            with self._condition:
                while not self._stopping and not self._waiting and not self._running:
                    self._condition.wait()
                if self._stopping:
                    break
                self._admit()
                jobs = list(self._running)
            self._iterate(jobs)
            with self._condition:
                self._running = [job for job in self._running if not job.done]
                self._publish_queue()
        for job in list(self._running):
            self._finish(job, "abort", error=job.cancel_error or RequestCancelled("the server is stopping"))

    def _admit(self) -> None:
        """Move waiting jobs into free running slots (caller holds the lock)."""
        while self._waiting and len(self._running) < self.max_running:
            self._running.append(self._waiting.popleft())
        self._publish_queue()

    def _iterate(self, jobs: list[Job]) -> None:
        """One step of every job: decoder streams batched into one forward, other iterators one by one."""
        batched: list[Job] = []
        for job in jobs:
            if job.cancel_requested:
                self._finish(job, "abort", error=job.cancel_error or RequestCancelled("cancelled"))
            elif isinstance(job.steps, DecodeStream):
                batched.append(job)
            else:
                self._advance(job)
        if batched:
            self._advance_batch(batched)

    def _advance_batch(self, jobs: list[Job]) -> None:
        """One packed forward for ``jobs``; each job consumes its own step or ends with its own error."""
        for job in jobs:
            if job.started is None:
                self._begin(job)
        results = step_batch([job.steps for job in jobs], self.policy)
        stepped = [result for result in results if result is not None and not isinstance(result, BaseException)]
        if self.metrics is not None and stepped:
            self.metrics.forward(len(stepped), sum(step.stats.input_tokens for step in stepped))
        for job, result in zip(jobs, results, strict=True):
            if result is None:  # waiting for its prefill chunk
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

    def _advance(self, job: Job) -> None:
        """Run one step of ``job`` (or finish it if cancelled); errors end this job only."""
        if job.cancel_requested:
            self._finish(job, "abort", error=job.cancel_error or RequestCancelled("cancelled"))
            return
        try:
            if job.started is None:
                self._begin(job)
            step = next(job.steps)
            self._consume(job, step)
        except StopIteration:
            self._end_of_steps(job)
        except Exception as exc:
            logger.exception("generation failed")
            self._finish(job, "error", error=exc)

    def _end_of_steps(self, job: Job) -> None:
        """The generator ended without a step carrying a finish reason: a decoder contract violation."""
        self._finish(job, "error", error=GenerationEnded("the decoder stopped without a finish reason"))

    def _begin(self, job: Job) -> None:
        job.started = job.last_step = time.perf_counter()
        if job.metrics is not None:
            job.metrics.request_started(job.prompt_tokens, job.started - job.arrived)

    def _consume(self, job: Job, step: Step) -> None:
        """Turn one step into text, count it, post it; finish the job on its last step."""
        now = time.perf_counter()
        job.step_count += 1
        delta = job.text.feed(step.token_ids)
        finish_reason = "stop" if delta.stopped else step.finish_reason
        accepted = min(step.stats.accepted, delta.tokens)
        positions = tuple(flag and k < accepted for k, flag in enumerate(step.stats.accepted_per_position))
        job.tally.add(delta.tokens, step.stats.offered, accepted)
        record = StepRecord(
            tokens=delta.tokens,
            seconds=step.stats.seconds,
            since_previous=now - job.last_step,
            offered=step.stats.offered,
            accepted=accepted,
            accepted_positions=positions,
            prefill=step.stats.prefill,
        )
        job.last_step = now
        if job.metrics is not None:
            job.metrics.step(record)
            if delta.tokens > 0 and not job.first_token_seen:
                job.metrics.first_token(now - job.arrived)
        job.first_token_seen = job.first_token_seen or delta.tokens > 0
        if finish_reason is None:
            if delta.text:
                job.post(job.output(delta.text))
            return
        final = job.output(delta.text + job.text.finish(), finish_reason, job.summary())
        self._finish(job, finish_reason, output=final)

    def _finish(
        self, job: Job, reason: str, output: Output | None = None, error: BaseException | None = None
    ) -> None:
        """End ``job`` once: close its generator, post its last item, count it."""
        with self._condition:
            if job.done:
                return
            job.done = True
            self._publish_queue()
        try:
            close = getattr(job.steps, "close", None)
            if close is not None:
                close()
        except Exception:
            logger.exception("closing a step generator failed")
        if job.metrics is not None:  # counted before the client can see its response
            t = job.tally
            elapsed = time.perf_counter() - job.arrived
            job.metrics.request_finished(
                RequestRecord(reason, t.completion_tokens, t.steps, t.offered, t.accepted, elapsed)
            )
        job.post(output if output is not None else error or RequestCancelled(reason))
