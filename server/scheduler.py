"""Admission and per-request channels on the asyncio side of the worker.

Contract: ``Scheduler.submit`` runs on the event loop; it refuses work while draining (503) or when the
running slots plus the bounded waiting queue are full (429 with ``Retry-After``), else hands a ``Job`` to the
``Worker`` and returns a ``Handle``. ``submit_many`` admits the sequences of one request (its prompts times
``n``) all or none: each is a job of its own and takes its own place in the slots and the queue; the worker's
registry checks the capacity and queues them in one step (``Worker.submit_many``), so the scheduler keeps no
count of its own. The worker
reports into the handle's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``; exceptions travel the same
way and are raised by the handle. ``Handle.cancel`` (client disconnect) stops the job at its next step, or at
once while it waits. ``drain`` stops admission, lets in-flight work finish for a grace period, then cancels
what is left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from decoding import TokenLogprob
from server.errors import QueueFullError, ServiceUnavailableError
from server.jobs import Job
from server.metrics import Metrics
from server.plans import GenerationPlan, Output
from server.text import TextStream
from server.worker import Worker

logger = logging.getLogger("server.scheduler")


class Handle:
    """The caller's end of one request: iterate its ``Output`` items; ``cancel`` on disconnect."""

    def __init__(self, job: Job, queue: asyncio.Queue, scheduler: Scheduler) -> None:
        self.job = job
        self._queue = queue
        self._scheduler = scheduler
        self.finished = False

    def __aiter__(self) -> AsyncIterator[Output]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[Output]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finish_reason is not None
            yield item

    async def collect(self) -> tuple[str, Output]:
        """Wait for the whole completion: its text and its last output (with finish reason and summary), whose
        ``logprobs``, when asked for, are the whole completion's."""
        pieces: list[str] = []
        logprobs: list[TokenLogprob] = []
        last: Output | None = None
        prompt_logprobs = None
        async for output in self:
            pieces.append(output.text)
            logprobs.extend(output.logprobs or ())
            prompt_logprobs = prompt_logprobs or output.prompt_logprobs
            last = output
        assert last is not None
        if last.logprobs is not None:
            last = replace(last, logprobs=tuple(logprobs))
        return "".join(pieces), replace(last, prompt_logprobs=prompt_logprobs)

    def cancel(self) -> None:
        """The client went away: cancel unless already finished (counted as a client disconnect)."""
        if self.finished or self.job.done:
            return
        self.finished = True
        if self.job.metrics is not None:
            self.job.metrics.client_disconnected()
        self._scheduler.worker.cancel(self.job)


class Scheduler:
    """Bounded admission in front of the worker."""

    def __init__(self, worker: Worker, max_queue: int, metrics: Metrics | None = None) -> None:
        self.worker = worker
        self.max_queue = max_queue
        self.metrics = metrics
        self.accepting = True

    @property
    def capacity(self) -> int:
        """Requests the server holds at once: running slots plus waiting places."""
        return self.worker.max_running + self.max_queue

    def submit(self, plan: GenerationPlan, text: TextStream, tracked: bool = True, force: bool = False) -> Handle:
        """Admit one validated generation (its text comes out of ``text``); raise ``ServiceUnavailableError`` or
        ``QueueFullError`` if refused.

        ``tracked=False`` keeps the request out of the metrics; ``force=True`` admits even while draining or
        full (the warm-up request).
        """
        return self.submit_many([(plan, text)], tracked, force)[0]

    def submit_many(
        self, generations: Sequence[tuple[GenerationPlan, TextStream]], tracked: bool = True, force: bool = False
    ) -> list[Handle]:
        """Admit several generations at once, all or none (as ``submit``): refused unless every one of them
        finds a place among the running slots and the waiting queue."""
        if not force and not self.accepting:
            raise ServiceUnavailableError("The server is shutting down; retry on another instance.", reason="draining")
        loop = asyncio.get_running_loop()
        handles = [self._handle(plan, text, tracked, loop) for plan, text in generations]
        if not self.worker.submit_many([handle.job for handle in handles], None if force else self.capacity):
            raise QueueFullError(
                f"The server is at capacity ({self.worker.max_running} running, {self.max_queue} waiting); "
                "retry after a short wait."
            )
        return handles

    def _handle(
        self, plan: GenerationPlan, text: TextStream, tracked: bool, loop: asyncio.AbstractEventLoop
    ) -> Handle:
        """One generation's job and handle: the worker reports into the handle's queue, from its thread."""
        queue: asyncio.Queue = asyncio.Queue()

        def post(item: Output | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        return Handle(Job(plan, text, post, self.metrics if tracked else None), queue, self)

    async def drain(self, grace_seconds: float) -> None:
        """Stop admitting; wait up to ``grace_seconds`` for in-flight work, then cancel the rest."""
        self.accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_seconds
        while self.worker.busy and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self.worker.busy:
            return
        logger.warning("drain grace period over: cancelling %d request(s)", self.worker.running + self.worker.waiting)
        self.worker.cancel_all(ServiceUnavailableError("The server is shutting down; the request was cancelled."))
        deadline = loop.time() + 10.0
        while self.worker.busy and loop.time() < deadline:
            await asyncio.sleep(0.02)
