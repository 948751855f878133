"""One server instance's state, apart from its routes: metrics, worker, scheduler, the decoder once loaded, and
readiness.

Contract: ``Runtime(config, decoder=None, load_decoder=None)`` owns the ``Metrics``, the ``Worker`` thread and the
``Scheduler`` in front of it. ``lifespan`` (the app's) starts the worker and boots in the background: loads the
decoder (``load_decoder``, default ``load_default_decoder``, unless one is injected), builds the engine (its
``decoding.BatchEngine``, ``engine``) from ``batch_policy(config)`` and attaches it to the worker, publishes the
configuration metrics and runs one tiny warm-up decode; ``state`` moves loading -> warming -> ready -> draining (or
-> failed, with ``boot_error`` set and ``on_boot_failure`` called). ``require_loaded`` is what every route asks
for: what a request needs (``serving.Loaded``: config, decoder, codec, scheduler), or 503 naming the state. The
endpoint modules (``server.chat``, ``server.completions``, ``server.responses``, ``server.corpus``,
``server.tokenization``) and the app (``server.app``) import it; it imports none of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from decoding import Decoder, SamplingParams, StopCriteria, configure_threads, native_steps
from server import serving
from server.auth import KeyChecker, load_api_keys
from server.config import ServerConfig, batch_policy
from server.errors import ServiceUnavailableError
from server.metrics import Metrics
from server.response_store import ResponseStore
from server.scheduler import Scheduler
from server.serving import Loaded
from server.text import TextCodec, read_chat_template
from server.worker import Worker

logger = logging.getLogger("server.app")


def load_default_decoder(config: ServerConfig) -> serving.DecoderLike:
    """Load the configured model with ``decoding.Decoder`` (blocking: run it in a thread)."""
    return Decoder.load(
        config.model,
        device=config.device,
        dtype=config.dtype,
        quantize=config.quantize,
        weight_layout=config.weight_layout,
        weights=config.weights,
    )


def configure_worker_thread(config: ServerConfig) -> Callable[[], None]:
    """The worker thread's setup: torch's threads and the native kernels' pool from the config."""

    def setup() -> None:
        configure_threads(config.threads, native_steps(config.quantize, config.weight_layout, config.device))

    return setup


class Runtime:
    """One server instance's state: metrics, worker, scheduler, the decoder once loaded, and readiness.

    ``state`` moves loading -> warming -> ready -> draining (or loading -> failed).
    """

    def __init__(
        self,
        config: ServerConfig,
        decoder: serving.DecoderLike | None = None,
        load_decoder: Callable[[ServerConfig], serving.DecoderLike] | None = None,
    ) -> None:
        self.config = config
        self.keys = KeyChecker(load_api_keys(config))
        self.chat_template = read_chat_template(config.chat_template) if config.chat_template else None
        self.metrics = Metrics()
        self.worker = Worker(config.max_running, self.metrics, configure_worker_thread(config),
                             overlap=config.batch.overlap_steps)
        self.scheduler = Scheduler(self.worker, config.max_queue, self.metrics)
        self.decoder = decoder
        self.load_decoder = load_decoder or load_default_decoder
        self.loaded: Loaded | None = None  # what requests need, once loaded and warmed up
        self.engine: serving.EngineLike | None = None  # the decoder's batch engine, the worker's once attached
        self.state = "loading"
        self.created = int(time.time())
        self.fingerprint = serving.system_fingerprint(config)
        self.stored_responses = ResponseStore(config.max_stored_responses)
        self._boot_task: asyncio.Task | None = None
        self.boot_error: Exception | None = None  # why the start failed, once it has
        # called (on the event loop) when the start fails: the CLI stops the process with a non-zero status
        self.on_boot_failure: Callable[[Exception], None] | None = None

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Start the worker and boot in the background; on shutdown, cancel what is left and stop."""
        self.worker.start()
        self._boot_task = asyncio.create_task(self._boot())
        try:
            yield
        finally:
            if not self._boot_task.done():
                self._boot_task.cancel()
            await self.drain(0.0)
            await asyncio.to_thread(self.worker.stop)
            await asyncio.to_thread(self._save_memory)

    async def _boot(self) -> None:
        try:
            if self.decoder is None:
                self.decoder = await asyncio.to_thread(self.load_decoder, self.config)
            settings = self.config.lookahead
            self.engine = await asyncio.to_thread(
                self.decoder.batch_engine, batch_policy(self.config), settings.memory_tokens, settings.memory_file,
                settings.memory_corpus,
            )
            self.worker.attach(self.engine)
            logger.info("steps %s", "overlapped: each step's results are delivered while the next one runs"
                        if self.worker.overlapping else "serial: each step's results are delivered before the next")
            codec = TextCodec(self.decoder.tokenizer, self.chat_template)
            loaded = Loaded(self.config, self.decoder, codec, self.scheduler)
            self._publish_config(loaded)
            self.state = "warming"
            if self.config.warmup:
                await self._warm_up(loaded)
            self.loaded = loaded
            if self.state == "warming":
                self.state = "ready"
                logger.info("ready: serving %s", self.config.model_name)
        except Exception as error:
            self.state = "failed"
            self.boot_error = error
            logger.exception("startup failed: the server will answer 503")
            if self.on_boot_failure is not None:
                self.on_boot_failure(error)

    def _save_memory(self) -> None:
        """At shutdown, once the worker has stopped: write the n-gram memory to ``lookahead.memory_file`` (when
        one is configured); a failure is logged, never raised."""
        path = self.config.lookahead.memory_file
        if path is None or self.engine is None or self.decoder is None:
            return
        try:
            documents = self.decoder.save_memory(self.engine, path)
        except OSError as error:
            logger.warning("could not save the n-gram memory to %s: %s", path, error)
            return
        if documents is not None:
            logger.info("n-gram memory: %d documents saved to %s", documents, path)

    def _publish_config(self, loaded: Loaded) -> None:
        lookahead = self.config.lookahead
        self.metrics.set_config(
            model=self.config.model_name,
            device=str(loaded.decoder.device),
            dtype=str(loaded.decoder.dtype),
            window_size=lookahead.window_size,
            ngram_size=lookahead.ngram_size,
            guess_set_size=lookahead.guess_set_size,
        )
        self.metrics.set_kv_capacity(self.config.max_running * loaded.decoder.context_length)
        policy = getattr(self.engine, "policy", None)
        if policy is not None:
            self.metrics.set_step_cost(policy.step_cost)
        stats = self.worker.publish_static()
        if stats is not None:
            logger.info("static step: %s, %d shapes built in %.1f s", stats.mode, stats.buckets,
                        stats.capture_seconds)

    async def _warm_up(self, loaded: Loaded) -> None:
        """One tiny decode with the default settings (untracked), so the first request pays no warm-up cost."""
        prompt = loaded.codec.encode_text("Hello")
        settings = self.config.lookahead
        generation = serving.GenerationPlan(
            prompt_ids=prompt or [0],
            stop=StopCriteria(2, frozenset(loaded.decoder.eos_token_ids())),
            sampling=SamplingParams(),
            lookahead=serving.resolve_lookahead(None, settings),
            stop_strings=(),
        )
        handle = serving.start(loaded, generation, tracked=False, force=True)
        await handle.collect()

    async def drain(self, grace_seconds: float) -> None:
        """Stop admitting (503 from now on), finish in-flight work for ``grace_seconds``, then cancel it."""
        if self.state in ("ready", "warming", "loading"):
            self.state = "draining"
        await self.scheduler.drain(grace_seconds)

    @property
    def alive(self) -> bool:
        """False once the start failed or the worker thread died: only a restart helps then."""
        return self.state != "failed" and self.worker.alive

    def vocab_size(self) -> int | None:
        """The loaded model's vocabulary size; ``None`` until the model is loaded."""
        return self.loaded.codec.vocab_size if self.loaded is not None else None

    def require_loaded(self) -> Loaded:
        """The ``Loaded`` pieces a request needs, or 503 while loading, warming up, draining or after a failed
        start."""
        if self.state == "draining":
            raise ServiceUnavailableError("The server is shutting down; retry on another instance.", reason="draining")
        if self.state != "ready" or self.loaded is None:
            raise ServiceUnavailableError(f"The server is not ready yet ({self.state}).", reason="not_ready")
        return self.loaded
