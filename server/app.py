"""The FastAPI app: a factory, thin routes, and the runtime that boots, serves and drains.

Contract: ``create_app(config, decoder=None, load_decoder=None)`` returns an ASGI app whose lifespan starts the
worker thread and, in the background, loads the decoder (unless one is injected), publishes the config
metric and runs one tiny warm-up decode; ``GET /health`` is 503 until then and again while draining. Routes
take typed bodies (protocol models FastAPI validates, read by ``server.body.json_body_route``: authorized first,
then bounded and strict JSON) and delegate to their endpoint module (``server.chat``, ``server.completions``,
``server.responses``, ``server.tokenization``, ``server.corpus``); prompts are tokenized off the event loop (in a
thread), so a huge prompt never stalls other streams; every error goes through ``server.errors`` (a validation
error is a 400 naming the field, from one handler).
Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` and
``GET /v1/responses/{id}`` (``server.responses``), ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/memory/corpus`` and ``GET /v1/memory`` (``server.corpus``: text added to the
n-gram memory while serving, and its usage), ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``
(vLLM's, keyed like ``/v1/*``),
``GET /health`` (readiness), ``GET /live`` (liveness: 503 only once the runtime has failed), ``GET /metrics``, and
the playground page: ``GET /`` and
``GET /static/*`` (``server/static``). With API keys configured (``api_key``, ``api_keys_file``), ``/v1/*``
requires ``Authorization: Bearer <key>`` (``server.auth``), and so do ``/health`` and ``/metrics`` with
``protect_health`` / ``protect_metrics``; the page itself is public and asks for the key. ``/openapi.json``
describes the real bodies (``server.openapi``). With ``allowed_origins``, every answer carries CORS headers for
those origins (``install_cors``); without, none.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from sse_starlette import EventSourceResponse

from decoding import BatchPolicy, Decoder, SamplingParams, StopCriteria, configure_threads
from server import chat, corpus, responses, serving, tokenization
from server import completions as completion
from server.auth import KeyChecker, load_api_keys
from server.body import json_body_route
from server.config import ServerConfig
from server.errors import (
    ModelNotFoundError,
    ServiceUnavailableError,
    install_error_handlers,
)
from server.metrics import Metrics
from server.openapi import install_openapi
from server.plans import Renderer
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CorpusRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    protocol_field_names,
)
from server.replies import ModelCard, ModelList
from server.responses_protocol import ResponseRequest
from server.scheduler import Handle, Scheduler
from server.serving import Engine
from server.text import TextCodec, read_chat_template
from server.worker import Worker

logger = logging.getLogger("server.app")
FIELD_NAMES = frozenset(protocol_field_names()) | responses.FIELD_NAMES  # what a 400 may name
SSE_PING_SECONDS = 15
CORS_METHODS = ("GET", "POST", "OPTIONS")
CORS_MAX_AGE_SECONDS = 600
STATIC_DIR = Path(__file__).parent / "static"


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
    """The worker thread's setup: torch's thread count from the config."""

    def setup() -> None:
        configure_threads(config.threads)

    return setup


def batch_policy(config: ServerConfig) -> BatchPolicy:
    """The engine's batching policy from the ``batch`` settings (the built-in CPU curve when none is given)."""
    settings = config.batch
    curve = tuple(tuple(point) for point in settings.step_cost) if settings.step_cost else BatchPolicy().step_cost
    return BatchPolicy(settings.max_step_tokens, settings.prefill_chunk, curve, settings.static_step,
                       config.max_running, settings.measure_step_cost, settings.prefix_cache_tokens)


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
        self.worker = Worker(config.max_running, self.metrics, configure_worker_thread(config))
        self.scheduler = Scheduler(self.worker, config.max_queue, self.metrics)
        self.decoder = decoder
        self.load_decoder = load_decoder or load_default_decoder
        self.engine: Engine | None = None
        self.batch: serving.EngineLike | None = None  # the worker's continuous batch, once attached
        self.state = "loading"
        self.created = int(time.time())
        self.fingerprint = serving.system_fingerprint(config)
        self.stored_responses = responses.ResponseStore(config.max_stored_responses)
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
            self.batch = await asyncio.to_thread(
                self.decoder.batch_engine, batch_policy(self.config), settings.memory_tokens, settings.memory_file,
                settings.memory_corpus,
            )
            self.worker.attach(self.batch)
            codec = TextCodec(self.decoder.tokenizer, self.chat_template)
            engine = Engine(self.config, self.decoder, codec, self.scheduler)
            self._publish_config(engine)
            self.state = "warming"
            if self.config.warmup:
                await self._warm_up(engine)
            self.engine = engine
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
        if path is None or self.batch is None or self.decoder is None:
            return
        try:
            documents = self.decoder.save_memory(self.batch, path)
        except OSError as error:
            logger.warning("could not save the n-gram memory to %s: %s", path, error)
            return
        if documents is not None:
            logger.info("n-gram memory: %d documents saved to %s", documents, path)

    def _publish_config(self, engine: Engine) -> None:
        lookahead = self.config.lookahead
        self.metrics.set_config(
            model=self.config.model_name,
            device=str(engine.decoder.device),
            dtype=str(engine.decoder.dtype),
            window_size=lookahead.window_size,
            ngram_size=lookahead.ngram_size,
            guess_set_size=lookahead.guess_set_size,
        )
        self.metrics.set_kv_capacity(self.config.max_running * engine.decoder.context_length)
        policy = getattr(self.batch, "policy", None)
        if policy is not None:
            self.metrics.set_step_cost(policy.step_cost)
        static = getattr(self.batch, "static_stats", None)
        stats = static() if static is not None else None
        if stats is not None:
            self.metrics.set_static(stats)
            logger.info("static step: %s, %d shapes built in %.1f s", stats.mode, stats.buckets,
                        stats.capture_seconds)

    async def _warm_up(self, engine: Engine) -> None:
        """One tiny decode with the default settings (untracked), so the first request pays no warm-up cost."""
        prompt = engine.codec.encode_text("Hello")
        settings = self.config.lookahead
        generation = serving.GenerationPlan(
            prompt_ids=prompt or [0],
            stop=StopCriteria(2, frozenset(engine.decoder.eos_token_ids())),
            sampling=SamplingParams(),
            lookahead=serving.resolve_lookahead(None, settings),
            stop_strings=(),
        )
        handle = serving.start(engine, generation, tracked=False, force=True)
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
        return self.engine.codec.vocab_size if self.engine is not None else None

    def require_engine(self) -> Engine:
        """The engine, or 503 while loading, warming up, draining or after a failed start."""
        if self.state == "draining":
            raise ServiceUnavailableError("The server is shutting down; retry on another instance.", reason="draining")
        if self.state != "ready" or self.engine is None:
            raise ServiceUnavailableError(f"The server is not ready yet ({self.state}).", reason="not_ready")
        return self.engine


def runtime_of(request: Request) -> Runtime:
    return request.app.state.runtime


async def require_api_key(request: Request) -> None:
    """Bearer-token check (constant-time, ``server.auth``) when API keys are configured."""
    runtime_of(request).keys.check(request.headers.get("authorization"))


def disconnect_watcher(request: Request) -> Callable[[], Any]:
    """A coroutine function that returns when the client disconnects (the body has been read already)."""

    async def wait() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    return wait


async def respond(request: Request, handles: list[Handle], renderer: Renderer, stream: bool) -> Response:
    """A streamed (SSE) or whole JSON response for a submitted request (one handle per choice)."""
    if stream:
        return EventSourceResponse(serving.stream(handles, renderer), sep="\n", ping=SSE_PING_SECONDS)
    return JSONResponse(await serving.complete(handles, renderer, disconnect_watcher(request)))


def body_limit(request: Request) -> int:
    """The most bytes a request body may have (``max_request_bytes``)."""
    return runtime_of(request).config.max_request_bytes


JSONBodyRoute = json_body_route(require_api_key, body_limit)
router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], route_class=JSONBodyRoute)


@router.post("/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    """A chat completion, whole or streamed (``server.chat``)."""
    handles, renderer = await chat.submit(runtime_of(request), body)
    return await respond(request, handles, renderer, bool(body.stream))


@router.post("/completions")
async def completions(request: Request, body: CompletionRequest) -> Response:
    """A text completion, whole or streamed (``server.completions``)."""
    handles, renderer = await completion.submit(runtime_of(request), body)
    return await respond(request, handles, renderer, bool(body.stream))


@router.post("/responses")
async def create_response(request: Request, body: ResponseRequest) -> Response:
    """OpenAI's Responses API, decoded on the chat path (``server.responses``)."""
    handles, renderer = await responses.submit(runtime_of(request), body)
    if body.stream:
        return EventSourceResponse(responses.events(handles, renderer), sep="\n", ping=SSE_PING_SECONDS)
    return JSONResponse(await serving.complete(handles, renderer, disconnect_watcher(request)))


@router.get("/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    """A stored response (404 when not stored)."""
    return runtime_of(request).stored_responses.get(response_id)


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    runtime = runtime_of(request)
    card = ModelCard(id=runtime.config.model_name, created=runtime.created)
    return ModelList(data=[card]).model_dump(mode="json")


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    runtime = runtime_of(request)
    if model_id != runtime.config.model_name:
        raise ModelNotFoundError(model_id)
    return ModelCard(id=model_id, created=runtime.created).model_dump(mode="json")


@router.post("/memory/corpus")
async def add_corpus(request: Request, body: CorpusRequest) -> dict[str, Any]:
    """Text added to the server-wide n-gram memory while serving (``server.corpus``)."""
    return await corpus.add(runtime_of(request), body)


@router.get("/memory")
async def memory_usage(request: Request) -> dict[str, Any]:
    """The server-wide n-gram memory's tokens, documents and capacity (``server.corpus``)."""
    return await corpus.usage(runtime_of(request))


tools = APIRouter(dependencies=[Depends(require_api_key)], route_class=JSONBodyRoute)


@tools.post("/tokenize")
async def tokenize(request: Request, body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's ``/tokenize``: a prompt or messages to the ids a completion or chat would decode from."""
    engine = checked_engine(request, body.model)
    ids = await asyncio.to_thread(tokenization.tokenize, engine.codec, body)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.decoder.context_length).model_dump()


@tools.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: the tokenizer's class, special tokens, chat template and the context length."""
    engine = runtime_of(request).require_engine()
    return TokenizerInfo(**engine.codec.info(), model_max_length=engine.decoder.context_length).model_dump()


@tools.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's ``/detokenize``: token ids to text."""
    engine = checked_engine(request, body.model)
    return DetokenizeResponse(prompt=await asyncio.to_thread(tokenization.detokenize, engine.codec, body)).model_dump()


def checked_engine(request: Request, model: str | None) -> Engine:
    """The engine for a ``/tokenize`` or ``/detokenize`` request whose ``model`` is checked (404 for another)."""
    runtime = runtime_of(request)
    serving.check_model(runtime.config, model)
    return runtime.require_engine()


async def health(request: Request) -> JSONResponse:
    """200 ``{"status": "ok"}`` once warmed up; 503 with the state (loading, warming, draining, failed)."""
    state = runtime_of(request).state
    return JSONResponse({"status": "ok" if state == "ready" else state}, status_code=200 if state == "ready" else 503)


async def live(request: Request) -> JSONResponse:
    """Liveness, apart from readiness: 200 ``{"status": "alive"}`` while loading, warming, ready or draining;
    503 ``{"status": "failed"}`` once the start failed or the worker thread died. Always open."""
    alive = runtime_of(request).alive
    return JSONResponse({"status": "alive" if alive else "failed"}, status_code=200 if alive else 503)


async def metrics(request: Request) -> Response:
    content, content_type = runtime_of(request).metrics.exposition()
    return Response(content, media_type=content_type)


async def playground() -> FileResponse:
    """The chat page (``server/static/index.html``); it loads ``/static/app.js`` and ``/static/style.css``."""
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def install_cors(app: FastAPI, origins: list[str]) -> None:
    """CORS for ``origins`` (none: no CORS headers at all). Added after the error middleware, so it wraps every
    answer, errors included; a preflight is answered before routing and auth (browsers send it without the key).

    Every request header is allowed: the ``openai`` JS SDK sends ``authorization``, ``content-type``, the
    ``x-stainless-*`` family, ``openai-organization`` and ``openai-project``; no credentials (cookies) are allowed.
    """
    if not origins:
        return
    app.add_middleware(
        CORSMiddleware, allow_origins=list(origins), allow_methods=list(CORS_METHODS), allow_headers=["*"],
        max_age=CORS_MAX_AGE_SECONDS,
    )


def create_app(
    config: ServerConfig,
    decoder: serving.DecoderLike | None = None,
    load_decoder: Callable[[ServerConfig], serving.DecoderLike] | None = None,
) -> FastAPI:
    """Build the app. ``decoder`` injects a loaded decoder; else ``load_decoder(config)`` (default: the real
    ``decoding.Decoder.load``) runs in a thread after startup."""
    runtime = Runtime(config, decoder, load_decoder)
    app = FastAPI(title="lookahead-server", lifespan=runtime.lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    install_error_handlers(app, FIELD_NAMES, runtime.metrics.reject)
    install_cors(app, config.allowed_origins)
    app.include_router(router)
    app.include_router(tools)
    guard = [Depends(require_api_key)]
    app.add_api_route("/health", health, methods=["GET"], dependencies=guard if config.protect_health else None)
    app.add_api_route("/live", live, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], dependencies=guard if config.protect_metrics else None)
    install_openapi(app, config, runtime.keys.enabled, runtime.vocab_size)
    app.add_api_route("/", playground, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
