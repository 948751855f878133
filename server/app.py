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
``protect_health`` / ``protect_metrics``; the page itself is public and asks for the key. Each route declares its
reply model and the error statuses it answers (``responses=``; 401 where the key is checked), from which
``/openapi.json`` is built (``server.openapi``). With ``allowed_origins``, every answer carries CORS headers for
those origins (``install_cors``); without, none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from sse_starlette import EventSourceResponse

from server import chat, corpus, responses, serving, tokenization
from server import completions as completion
from server.body import json_body_route
from server.completion_objects import ChatCompletion, Completion, ModelCard, ModelList
from server.config import ServerConfig
from server.errors import (
    ModelNotFoundError,
    error_responses,
    install_error_handlers,
)
from server.openapi import install_openapi
from server.plans import Renderer
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CorpusAdded,
    CorpusRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthStatus,
    MemoryInfo,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    protocol_field_names,
)
from server.responses_protocol import ResponseObject, ResponseRequest
from server.runtime import Runtime
from server.scheduler import Handle
from server.serving import Loaded
from server.sse import STREAMED

logger = logging.getLogger("server.app")
FIELD_NAMES = frozenset(protocol_field_names()) | responses.FIELD_NAMES  # what a 400 may name
SSE_PING_SECONDS = 15
CORS_METHODS = ("GET", "POST", "OPTIONS")
CORS_MAX_AGE_SECONDS = 600
STATIC_DIR = Path(__file__).parent / "static"
# What the routes answer besides their 200 (401 is added where the API key is checked: create_app).
GENERATION = {**STREAMED, **error_responses(400, 404, 413, 429, 500, 503)}
TOKENS = error_responses(400, 404, 413, 500, 503)  # /tokenize, /detokenize: no queue, so never 429
NEEDS_MODEL = error_responses(500, 503)
PLAIN_TEXT = {"text/plain": {"schema": {"type": "string"}}}
HEALTH = {200: {"description": "Ready."}, 503: {"model": HealthStatus, "description": "Not ready, or draining."}}
METRICS = {200: {"description": "Prometheus text exposition.", "content": PLAIN_TEXT}}


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


@router.post("/chat/completions", response_model=ChatCompletion, responses=GENERATION)
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    """A chat completion, whole or streamed (``server.chat``)."""
    handles, renderer = await chat.submit(runtime_of(request), body)
    return await respond(request, handles, renderer, bool(body.stream))


@router.post("/completions", response_model=Completion, responses=GENERATION)
async def completions(request: Request, body: CompletionRequest) -> Response:
    """A text completion, whole or streamed (``server.completions``)."""
    handles, renderer = await completion.submit(runtime_of(request), body)
    return await respond(request, handles, renderer, bool(body.stream))


@router.post("/responses", response_model=ResponseObject, responses=GENERATION)
async def create_response(request: Request, body: ResponseRequest) -> Response:
    """OpenAI's Responses API, decoded on the chat path (``server.responses``)."""
    handles, renderer = await responses.submit(runtime_of(request), body)
    if body.stream:
        return EventSourceResponse(responses.events(handles, renderer), sep="\n", ping=SSE_PING_SECONDS)
    return JSONResponse(await serving.complete(handles, renderer, disconnect_watcher(request)))


@router.get("/responses/{response_id}", response_model=ResponseObject, responses=error_responses(404))
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    """A stored response (404 when not stored)."""
    return runtime_of(request).stored_responses.get(response_id)


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> dict[str, Any]:
    runtime = runtime_of(request)
    card = ModelCard(id=runtime.config.model_name, created=runtime.created)
    return ModelList(data=[card]).model_dump(mode="json")


@router.get("/models/{model_id:path}", response_model=ModelCard, responses=error_responses(404))
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    runtime = runtime_of(request)
    if model_id != runtime.config.model_name:
        raise ModelNotFoundError(model_id)
    return ModelCard(id=model_id, created=runtime.created).model_dump(mode="json")


@router.post("/memory/corpus", response_model=CorpusAdded, responses=error_responses(400, 413, 500, 503))
async def add_corpus(request: Request, body: CorpusRequest) -> dict[str, Any]:
    """Text added to the server-wide n-gram memory while serving (``server.corpus``)."""
    return await corpus.add(runtime_of(request), body)


@router.get("/memory", response_model=MemoryInfo, responses=NEEDS_MODEL)
async def memory_usage(request: Request) -> dict[str, Any]:
    """The server-wide n-gram memory's tokens, documents and capacity (``server.corpus``)."""
    return await corpus.usage(runtime_of(request))


tools = APIRouter(dependencies=[Depends(require_api_key)], route_class=JSONBodyRoute)


@tools.post("/tokenize", response_model=TokenizeResponse, responses=TOKENS)
async def tokenize(request: Request, body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's ``/tokenize``: a prompt or messages to the ids a completion or chat would decode from."""
    loaded = checked_loaded(request, body.model)
    ids = await asyncio.to_thread(tokenization.tokenize, loaded.codec, body)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=loaded.decoder.context_length).model_dump()


@tools.get("/tokenizer_info", response_model=TokenizerInfo, responses=NEEDS_MODEL)
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: the tokenizer's class, special tokens, chat template and the context length."""
    loaded = runtime_of(request).require_loaded()
    return TokenizerInfo(**loaded.codec.info(), model_max_length=loaded.decoder.context_length).model_dump()


@tools.post("/detokenize", response_model=DetokenizeResponse, responses=TOKENS)
async def detokenize(request: Request, body: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's ``/detokenize``: token ids to text."""
    loaded = checked_loaded(request, body.model)
    return DetokenizeResponse(prompt=await asyncio.to_thread(tokenization.detokenize, loaded.codec, body)).model_dump()


def checked_loaded(request: Request, model: str | None) -> Loaded:
    """``require_loaded`` for a ``/tokenize`` or ``/detokenize`` request whose ``model`` is checked (404 for
    another)."""
    runtime = runtime_of(request)
    serving.check_model(runtime.config, model)
    return runtime.require_loaded()


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
    unauthorized = error_responses(401) if runtime.keys.enabled else {}
    app.include_router(router, responses=unauthorized)
    app.include_router(tools, responses=unauthorized)
    guard = [Depends(require_api_key)]
    health_guard, metrics_guard = config.protect_health, config.protect_metrics
    app.add_api_route("/health", health, methods=["GET"], dependencies=guard if health_guard else None,
                      response_model=HealthStatus, responses={**HEALTH, **(unauthorized if health_guard else {})})
    app.add_api_route("/live", live, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], dependencies=guard if metrics_guard else None,
                      response_class=Response, responses={**METRICS, **(unauthorized if metrics_guard else {})})
    install_openapi(app, config, runtime.vocab_size)
    app.add_api_route("/", playground, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
