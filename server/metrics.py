"""Every Prometheus collector the server exports, declared here and nowhere else.

Contract: ``Metrics`` owns its own ``CollectorRegistry`` (so tests can build many apps in one process) and is
fed plain data by the scheduler and the worker: per forward pass of a request, its ``decoding.StepCounts``
(what the step kept) with its timings; per finished request, its reason and summed ``StepCounts``; plus
``rejected``, ``client_disconnected`` and the queue gauges. It never sees tensors.

Semantics (all names carry the ``lookahead_`` prefix; no per-request labels):
- token and step counters count what requests really produced, cancelled and failed requests included
  (tokens after a stop string are not produced: they are neither sent nor counted);
- ``decode_steps_total`` counts forward passes that produced at least one token, the prefill included;
- ``draft_tokens_total`` counts guessed tokens offered (N-1 for each step that verified at least one
  candidate) and ``accepted_tokens_total`` the guessed tokens accepted (and kept); ``memory_accepted_tokens_total``
  counts those of them that came from the server-wide n-gram memory (``decoding.proposers.ngram_memory``);
  ``source_offered_tokens_total{source}`` and ``source_accepted_tokens_total{source}`` count, per candidate source
  (``decoding.proposers``: pool, copy, memory, prediction, ...), the guessed tokens it offered (the longest of its
  verified guesses per step) and those of the accepted ones it proposed; sources overlap, so they do not sum to
  the totals above;
- ``corpus_documents_total`` and ``corpus_tokens_total`` count the documents and tokens ``POST /v1/memory/corpus``
  added to the n-gram memory (a long text is several documents; later eviction does not take them back);
- per-request histograms (acceptance rate, steps per token, tokens per step, end-to-end latency) observe
  requests that finished with ``stop`` or ``length`` only: a cancelled request's ratios are partial;
- ``inter_token_latency_seconds`` is per token: the wall time since the request's previous step (its own
  forward pass plus the steps of other requests interleaved with it) shared by the tokens the step kept;
- ``batch_requests`` and ``batch_input_tokens`` observe each batched forward pass: how many requests it
  advanced and how many input tokens it ran (prefill chunks, windows and candidates included);
- ``kv_cache_tokens`` is the tokens the running requests hold in their caches (prompt plus completion so far;
  each request has its own cache, allocated as it grows), ``kv_cache_capacity_tokens`` what the running slots
  can hold at most (``max_running`` x the model's context length), and ``kv_cache_usage_ratio`` the one over
  the other (0..1; 0 until the capacity is known): the load signal a router or an autoscaler reads beside
  ``requests_running`` and ``requests_waiting``;
- ``static_buckets``, ``static_capture_failures`` and ``static_capture_seconds`` describe the static step
  (``decoding.forward.static``): the shapes built so far, the captures that failed on a working device (their shapes run
  eagerly), and the seconds building them took (absent without a static step);
- ``prefix_cache_hits_total`` / ``prefix_cache_misses_total`` count the engine's prefix-cache lookups (a request
  that opted out, or reads prompt logprobs, looks nothing up), ``prefix_cache_cached_tokens_total`` the prompt
  tokens reused (not computed), ``prefix_cache_evictions_total`` entries dropped for room (least recently used
  first), and ``prefix_cache_tokens`` / ``prefix_cache_bytes`` what the cache holds now (``decoding.step.prefix_cache``;
  all 0 when it is off);
- ``step_cost{tokens}`` is the step-cost curve the engine prices drafts on (relative to a one-token forward):
  measured on the device at start (``batch.measure_step_cost``), else the preset's;
- ``time_to_first_token_seconds`` runs from arrival to the first step that kept a token, so it includes
  queueing; ``request_queue_time_seconds`` from arrival to the start of the prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:  # only read here; importing decoding would load torch for the deployment tests
    from decoding import StepCounts
    from decoding.forward.static import StaticStats
    from decoding.step.prefix_cache import PrefixCacheStats

PREFIX = "lookahead"
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("queue_full", "not_ready", "draining", "invalid_request", "unauthorized", "model_not_found")

# CPU steps take ~50-300 ms and GPU steps ~10-40 ms; SLO edges at 0.1 s, 0.25 s (ITL) and 1 s, 5 s (TTFT).
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TOKENS_PER_STEP_BUCKETS = (1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
BATCH_REQUESTS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
BATCH_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class Metrics:
    """The collectors, in their own registry, and the methods that feed them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, buckets=buckets, registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Completion tokens produced (sent to clients).")
        self.decode_steps = counter("decode_steps", "Forward passes that produced tokens, prefill included.")
        self.draft_tokens = counter(
            "draft_tokens",
            "Guessed tokens offered for verification (N-1 per step; a copy step up to copy_stretch x copy_length).",
        )
        self.accepted_tokens = counter("accepted_tokens", "Guessed tokens accepted.")
        self.memory_accepted_tokens = counter(
            "memory_accepted_tokens", "Guessed tokens accepted that came from the server-wide n-gram memory."
        )
        self.source_offered_tokens = counter(
            "source_offered_tokens", "Guessed tokens offered by each candidate source (its longest verified guess "
            "per step).", ("source",)
        )
        self.source_accepted_tokens = counter(
            "source_accepted_tokens", "Accepted guessed tokens each candidate source proposed (sources overlap).",
            ("source",)
        )
        self.accepted_per_position = counter(
            "accepted_tokens_per_position",
            "Guessed tokens accepted, by position 1..N-1 (up to copy_stretch x copy_length for copy steps).",
            ("position",),
        )
        self.corpus_documents = counter(
            "corpus_documents", "Documents added to the server-wide n-gram memory by POST /v1/memory/corpus."
        )
        self.corpus_tokens = counter(
            "corpus_tokens", "Tokens added to the server-wide n-gram memory by POST /v1/memory/corpus."
        )
        self.requests = counter("requests", "Finished requests by finish reason.", ("finish_reason",))
        self.rejected = counter("requests_rejected", "Requests refused before decoding, by reason.", ("reason",))
        self.client_disconnects = counter("client_disconnects", "Requests cancelled by a client disconnect.")

        self.acceptance_rate = histogram("acceptance_rate", "Per request: accepted / offered guesses.", RATIO_BUCKETS)
        self.steps_per_token = histogram(
            "steps_per_token", "Per request: steps / completion tokens.", RATIO_BUCKETS
        )
        self.tokens_per_step = histogram(
            "tokens_per_step", "Per request: completion tokens / steps.", TOKENS_PER_STEP_BUCKETS
        )
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Per token: step wall time / tokens.", STEP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to prefill start.", QUEUE_BUCKETS)
        self.step_duration = histogram("step_duration_seconds", "One forward pass.", STEP_BUCKETS)
        self.batch_requests = histogram(
            "batch_requests", "Per batched forward pass: requests it advanced.", BATCH_REQUESTS_BUCKETS
        )
        self.batch_input_tokens = histogram(
            "batch_input_tokens", "Per batched forward pass: input tokens, all requests together.", BATCH_TOKENS_BUCKETS
        )
        self.forwards = counter(
            "forwards", "Batched forward passes by how they ran: graph (a replayed CUDA graph of the static step), "
            "static (the static step, no graph), eager.", ("path",)
        )

        self.running = Gauge(f"{PREFIX}_requests_running", "Requests decoding now.", registry=registry)
        self.waiting = Gauge(f"{PREFIX}_requests_waiting", "Requests admitted, waiting to run.", registry=registry)
        self.kv_tokens = Gauge(
            f"{PREFIX}_kv_cache_tokens", "Tokens held in the running requests' KV caches.", registry=registry
        )
        self.kv_capacity = Gauge(
            f"{PREFIX}_kv_cache_capacity_tokens", "Tokens the running slots can hold: max_running x context length.",
            registry=registry,
        )
        self.kv_usage = Gauge(
            f"{PREFIX}_kv_cache_usage_ratio", "KV-cache tokens held / capacity (0..1).", registry=registry
        )
        self._kv = (0, 0)  # (tokens held, capacity), the last values set
        self.static_buckets = Gauge(
            f"{PREFIX}_static_buckets", "Static-step shapes built (captured as CUDA graphs in graphs mode).",
            registry=registry,
        )
        self.static_capture_failures = Gauge(
            f"{PREFIX}_static_capture_failures", "CUDA graph captures that failed on a working device (those "
            "shapes then run eagerly); a capture that breaks the device fails the start instead.", registry=registry,
        )
        self.static_capture_seconds = Gauge(
            f"{PREFIX}_static_capture_seconds", "Seconds spent building and capturing static-step shapes.",
            registry=registry,
        )
        self._static: StaticStats | None = None
        self.prefix_hits = counter("prefix_cache_hits", "Prefix-cache lookups that found a reusable prefix.")
        self.prefix_misses = counter("prefix_cache_misses", "Prefix-cache lookups that found none.")
        self.prefix_cached_tokens = counter(
            "prefix_cache_cached_tokens", "Prompt tokens whose KV came from the prefix cache, not a forward.")
        self.prefix_evictions = counter("prefix_cache_evictions", "Prefix-cache entries dropped for room (LRU).")
        self.prefix_tokens = Gauge(f"{PREFIX}_prefix_cache_tokens", "Tokens of KV the prefix cache holds.",
                                   registry=registry)
        self.prefix_bytes = Gauge(f"{PREFIX}_prefix_cache_bytes", "Bytes of KV the prefix cache holds.",
                                  registry=registry)
        self._prefix: PrefixCacheStats | None = None
        self.step_cost = Gauge(
            f"{PREFIX}_step_cost", "The step-cost curve drafts are priced on: a forward of `tokens` input tokens "
            "against one (measured at start with batch.measure_step_cost, else the preset's).", ("tokens",),
            registry=registry,
        )
        self.config = Info(f"{PREFIX}_config", "Model and lookahead configuration.", registry=registry)

        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)

    def set_config(self, model: str, device: str, dtype: str, window_size: int, ngram_size: int,
                   guess_set_size: int) -> None:
        """Publish ``lookahead_config_info`` and pre-create the per-position series for N-1 positions."""
        self.config.info({
            "model": model, "device": device, "dtype": dtype, "window_size": str(window_size),
            "ngram_size": str(ngram_size), "guess_set_size": str(guess_set_size),
        })
        for position in range(1, ngram_size):
            self.accepted_per_position.labels(position=str(position))

    def request_started(self, prompt_tokens: int, queue_seconds: float) -> None:
        """A request left the queue and starts its prefill."""
        self.prompt_tokens.inc(prompt_tokens)
        self.queue_time.observe(queue_seconds)

    def first_token(self, seconds_since_arrival: float) -> None:
        self.ttft.observe(seconds_since_arrival)

    def step(self, counts: StepCounts, seconds: float, since_previous: float, prefill: bool = False) -> None:
        """Count one forward pass of one request: what it kept (``counts``), the pass's own ``seconds``, and the
        wall time ``since_previous`` step of the same request (or since its prefill started)."""
        self.step_duration.observe(seconds)
        self.draft_tokens.inc(counts.offered)
        self.accepted_tokens.inc(counts.accepted)
        self.memory_accepted_tokens.inc(counts.memory_accepted)
        for source, offered, accepted in counts.sources:
            self.source_offered_tokens.labels(source=source).inc(offered)
            self.source_accepted_tokens.labels(source=source).inc(accepted)
        for position, accepted in enumerate(counts.accepted_per_position, start=1):
            if accepted:
                self.accepted_per_position.labels(position=str(position)).inc(accepted)
        if counts.tokens <= 0:
            return
        self.generation_tokens.inc(counts.tokens)
        self.decode_steps.inc(counts.steps)
        if not prefill:
            per_token = since_previous / counts.tokens
            for _ in range(counts.tokens):
                self.itl.observe(per_token)

    def forward(self, requests: int, input_tokens: int, path: str = "eager") -> None:
        """Count one batched forward pass over ``requests`` requests and ``input_tokens`` tokens, run as ``path``
        says (graph | static | eager)."""
        self.batch_requests.observe(requests)
        self.batch_input_tokens.observe(input_tokens)
        self.forwards.labels(path=path).inc()

    def request_finished(self, finish_reason: str, counts: StepCounts, e2e_seconds: float) -> None:
        """Count a finished request (``finish_reason``: stop | length | abort | error; ``counts``: all its
        steps); per-request ratios only for requests that ran to stop or length."""
        self.requests.labels(finish_reason=finish_reason).inc()
        if finish_reason not in ("stop", "length"):
            return
        self.e2e.observe(e2e_seconds)
        if counts.offered > 0:
            self.acceptance_rate.observe(counts.accepted / counts.offered)
        if counts.tokens > 0 and counts.steps > 0:
            self.steps_per_token.observe(counts.steps / counts.tokens)
            self.tokens_per_step.observe(counts.tokens / counts.steps)

    def corpus_added(self, documents: int, tokens: int) -> None:
        """Count ``documents`` of ``tokens`` tokens in all added to the n-gram memory as a corpus."""
        self.corpus_documents.inc(documents)
        self.corpus_tokens.inc(tokens)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def client_disconnected(self) -> None:
        self.client_disconnects.inc()

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def set_kv_capacity(self, tokens: int) -> None:
        """The tokens the running slots can hold at most (``max_running`` x context length), once known."""
        self._kv = (self._kv[0], tokens)
        self.kv_capacity.set(tokens)
        self._publish_kv_usage()

    def set_kv_tokens(self, tokens: int) -> None:
        """The tokens the running requests hold in their caches now."""
        self._kv = (tokens, self._kv[1])
        self.kv_tokens.set(tokens)
        self._publish_kv_usage()

    def set_step_cost(self, curve: Sequence[tuple[int, float]]) -> None:
        """The step-cost curve the engine prices drafts on, one series per point."""
        for tokens, cost in curve:
            self.step_cost.labels(tokens=str(tokens)).set(cost)

    def set_static(self, stats: StaticStats) -> None:
        """The static step's buckets, capture failures and capture seconds (published when they change)."""
        if stats == self._static:
            return
        self._static = stats
        self.static_buckets.set(stats.buckets)
        self.static_capture_failures.set(stats.capture_failures)
        self.static_capture_seconds.set(stats.capture_seconds)

    def set_prefix_cache(self, stats: PrefixCacheStats) -> None:
        """The prefix cache's contents, and its counters' growth since the last call (``PrefixCacheStats``)."""
        last = self._prefix
        self._prefix = stats
        if last is None or stats.hits < last.hits:  # the first report (or a new engine): counted from zero
            last = type(stats)()
        self.prefix_hits.inc(stats.hits - last.hits)
        self.prefix_misses.inc(max(0, stats.misses - last.misses))
        self.prefix_cached_tokens.inc(max(0, stats.cached_tokens - last.cached_tokens))
        self.prefix_evictions.inc(max(0, stats.evictions - last.evictions))
        self.prefix_tokens.set(stats.tokens)
        self.prefix_bytes.set(stats.bytes)

    def _publish_kv_usage(self) -> None:
        tokens, capacity = self._kv
        self.kv_usage.set(min(1.0, tokens / capacity) if capacity > 0 else 0.0)

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
