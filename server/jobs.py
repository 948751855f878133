"""What the worker runs: the engine's interface (``EngineLike``) and one request's record (``Job``).

Contract: ``EngineLike`` is the continuous batch the worker (``server.worker``) drives, ``decoding.BatchEngine`` in
production, a scripted stand-in in the server's tests; only the worker thread calls it. A ``Job`` is one request as
the worker sees it: its plan, its ``TextStream``, where its outputs go (``post``) and its counts so far; ``output``
makes its next ``Output`` (the counts since the previous one) and ``summary`` its finished request's numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from decoding import (
    LookaheadConfig,
    MemoryUsage,
    SamplingParams,
    Step,
    StepCounts,
    StopCriteria,
    TokenLogprob,
)
from server.metrics import Metrics
from server.plans import GenerationPlan, Output, Summary
from server.text import TextStream


class EngineLike(Protocol):
    """The continuous batch the worker drives (``decoding.BatchEngine``); only the worker thread calls it."""

    @property
    def has_work(self) -> bool: ...

    def __contains__(self, request_id: Hashable) -> bool: ...

    def add(
        self,
        request_id: Hashable,
        prompt_ids: Sequence[int],
        stop: StopCriteria,
        sampling: SamplingParams,
        lookahead: LookaheadConfig | None,
        prediction: Sequence[int] | None = None,
        cache_prompt: bool = True,
    ) -> None: ...

    def step(self) -> list[tuple[Hashable, Step | BaseException]]: ...

    # optional, for overlapped steps: ``launch() -> handle`` (plan the step and start its forward) and
    # ``complete(handle)`` (read it: ``step``'s results), nothing else called in between; ``asynchronous`` (True
    # where the device runs a launched step while the host goes on: overlapping pays there)

    def cancel(self, request_id: Hashable) -> None: ...

    def add_documents(self, documents: Sequence[Sequence[int]]) -> MemoryUsage | None: ...

    # optional: ``prefix_cache_stats() -> decoding.step.prefix_cache.PrefixCacheStats | None`` (read when present)

    def memory_usage(self) -> MemoryUsage | None: ...


@dataclass(eq=False)
class Job:
    """One request as the worker sees it. ``post`` must be safe to call from the worker thread."""

    plan: GenerationPlan
    text: TextStream
    post: Callable[[Output | BaseException], None]
    metrics: Metrics | None = None  # None: not counted (the warm-up request)
    arrived: float = field(default_factory=time.perf_counter)
    totals: StepCounts = StepCounts()
    reported: StepCounts = StepCounts()  # the totals as of the last posted output
    pending_logprobs: list[TokenLogprob] | None = None  # kept tokens' logprobs not yet posted (None: not asked)
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's, gathered over the prefill, until posted
    cancel_requested: bool = False
    cancel_error: BaseException | None = None
    started: float | None = None
    last_step: float = 0.0
    first_token_seen: bool = False
    done: bool = False
    cached_tokens: int = 0  # prompt tokens whose KV came from the engine's prefix cache

    def summary(self) -> Summary:
        prediction, sampling = self.plan.prediction, self.plan.sampling
        return Summary(len(self.plan.prompt_ids), self.totals, self.plan.lookahead,
                       None if prediction is None else len(prediction), None if sampling.greedy else sampling.seed,
                       self.cached_tokens)

    def output(self, text: str, finish_reason: str | None = None, summary: Summary | None = None) -> Output:
        """An output carrying the counts since the previous one."""
        logprobs = None if self.pending_logprobs is None else tuple(self.pending_logprobs)
        prompt = None if self.prompt_logprobs is None else tuple(self.prompt_logprobs)
        output = Output(text, finish_reason, summary, self.totals - self.reported, logprobs, prompt)
        self.reported = self.totals
        self.prompt_logprobs = None
        self.pending_logprobs = None if self.pending_logprobs is None else []
        return output
