"""Test helpers: run an app with its lifespan in-process, a scripted stand-in decoder, raw ASGI calls.

``ScriptedDecoder`` replays token-id steps chosen by the prompt's text (through the real tokenizer), so
scheduler and HTTP tests control timing (gates), failures and token accounting exactly. Its ``batch_engine``
is a ``ScriptedEngine``: the same add / step / cancel interface as ``decoding.BatchEngine``, so the worker
runs the very loop it runs in production, with a real ``NGramMemory`` of ``memory_tokens`` (none for 0) behind
its ``add_documents`` / ``memory_usage``, which only the corpus endpoint feeds.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from decoding import MemoryUsage, NGramMemory, Step, StepStats
from server.app import create_app
from server.config import ServerConfig
from server.sse import data_events


async def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def running_app(
    config: ServerConfig, decoder: Any = None, load_decoder: Any = None, wait_ready: bool = True,
    raise_app_exceptions: bool = True,
) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """Create the app, run its lifespan, and yield it with an in-process client."""
    app = create_app(config, decoder=decoder, load_decoder=load_decoder)
    async with app.router.lifespan_context(app):
        if wait_ready:
            await wait_for(lambda: app.state.runtime.state == "ready", what="ready")
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=120) as client:
            yield app, client


def sse_events(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (``server.sse``)."""
    return data_events(body)


def scrape(app: Any) -> dict[str, float]:
    """Every sample of the app's registry as ``name{label="v",...}`` -> value (labels sorted)."""
    content, _ = app.state.runtime.metrics.exposition()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(content.decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@dataclass
class Script:
    """What the scripted decoder does for one prompt: steps of token ids, then a finish reason."""

    steps: list[list[int]]
    finish_reason: str = "length"
    fail_at: int | None = None  # raise RuntimeError instead of producing this step
    gate: threading.Event | None = None  # every step waits for this event
    gate_steps: tuple[int, ...] | None = None  # only these steps wait (None: all)
    delay: float = 0.0  # seconds each step takes (a simulated forward pass)
    offered: int = 3
    accepted_per_step: int = 0


@dataclass
class ScriptedDecoder:
    """A stand-in for ``decoding.Decoder``: ``script_for(prompt_text)`` decides the steps."""

    tokenizer: Any
    script_for: Callable[[str], Script]
    context_length: int = 8192
    device: str = "cpu"
    dtype: str = "float32"
    linears: str = "torch"
    step_log: list[tuple[str, int]] = field(default_factory=list)  # (prompt text, step index) in run order
    closed: list[str] = field(default_factory=list)
    raise_on_validate: Exception | None = None
    memory_tokens: int | None = None  # what the server asked batch_engine for
    memory_file: str | None = None  # likewise
    saved_memory: list[str] = field(default_factory=list)  # the files save_memory was called with, in order
    lookaheads: list[Any] = field(default_factory=list)  # the LookaheadConfig of each request added, in order
    validated: list[tuple[Any, Any]] = field(default_factory=list)  # (StopCriteria, SamplingParams) validated
    validated_on: list[str] = field(default_factory=list)  # the name of the thread of each validation, in order
    memory_added_on: list[str] = field(default_factory=list)  # the thread of each add_documents call, in order

    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self.tokenizer.eos_token_id})

    def validate(self, prompt_ids: Sequence[int], stop: Any, sampling: Any, lookahead: Any) -> None:
        if self.raise_on_validate is not None:
            raise self.raise_on_validate
        self.validated.append((stop, sampling))
        self.validated_on.append(threading.current_thread().name)
        stop.validate()  # the real decoder's parameter checks (InvalidParameterError naming the field)
        sampling.validate()

    def batch_engine(
        self, policy: Any = None, memory_tokens: int = 0, memory_file: str | None = None,
        memory_corpus: Sequence[str] = (),
    ) -> ScriptedEngine:
        self.memory_tokens, self.memory_file, self.memory_corpus = memory_tokens, memory_file, list(memory_corpus)
        return ScriptedEngine(self)

    def save_memory(self, engine: ScriptedEngine, memory_file: str) -> int:
        self.saved_memory.append(memory_file)
        return 0

    def steps_for(self, prompt_ids: Sequence[int], max_tokens: int) -> Iterator[Step]:
        """The scripted steps of one request: the script its prompt's text selects."""
        text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
        return self._steps(text, self.script_for(text), max_tokens)

    def _steps(self, text: str, script: Script, max_tokens: int):
        produced = 0
        try:
            for index, token_ids in enumerate(script.steps):
                if script.gate is not None and (script.gate_steps is None or index in script.gate_steps):
                    script.gate.wait(30)
                if script.delay:
                    time.sleep(script.delay)
                if script.fail_at == index:
                    raise RuntimeError("scripted failure")
                self.step_log.append((text, index))
                token_ids = token_ids[: max_tokens - produced]
                produced += len(token_ids)
                last = index == len(script.steps) - 1 or produced >= max_tokens
                accepted = min(script.accepted_per_step, max(len(token_ids) - 1, 0))
                stats = StepStats(
                    input_tokens=1, committed=len(token_ids), offered=0 if index == 0 else script.offered,
                    accepted=0 if index == 0 else accepted,
                    accepted_per_position=() if index == 0 else tuple(k < accepted for k in range(script.offered)),
                    seconds=0.001, prefill=index == 0,
                )
                reason = ("length" if produced >= max_tokens else script.finish_reason) if last else None
                yield Step(list(token_ids), stats, reason)
                if last:
                    return
        finally:
            self.closed.append(text)


Results = list[tuple[Hashable, Step | BaseException]]


class ScriptedEngine:
    """``decoding.BatchEngine``'s interface over scripted steps: each ``step`` advances every request once, in
    the order they were added; a request whose step finishes or raises leaves by itself; ``cancel`` closes it.
    ``launch`` / ``complete`` split a step as the real engine's do (its results made at ``launch``), and, as
    there, ``add`` and ``cancel`` raise between them."""

    def __init__(self, decoder: ScriptedDecoder) -> None:
        self.decoder = decoder
        self._requests: dict[Hashable, Iterator[Step]] = {}
        self.memory = NGramMemory(decoder.memory_tokens) if decoder.memory_tokens else None
        self.in_flight: Results | None = None
        self.asynchronous = False

    def launch(self) -> Results:
        assert self.in_flight is None, "launch() while a step is in flight"
        self.in_flight = self.step()
        return self.in_flight

    def complete(self, launched: Results) -> Results:
        assert launched is self.in_flight, "complete() of a step not in flight"
        self.in_flight = None
        return launched

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def add(
        self, request_id: Hashable, prompt_ids: Sequence[int], stop: Any, sampling: Any, lookahead: Any,
        prediction: Any = None, cache_prompt: bool = True,
    ) -> None:
        if self.in_flight is not None:
            raise RuntimeError("add() while a step is in flight")
        self.decoder.validate(prompt_ids, stop, sampling, lookahead)
        self.decoder.lookaheads.append(lookahead)
        self._requests[request_id] = self.decoder.steps_for(prompt_ids, stop.max_tokens)

    def step(self) -> list[tuple[Hashable, Step | BaseException]]:
        results: list[tuple[Hashable, Step | BaseException]] = []
        for request_id, steps in list(self._requests.items()):
            try:
                step = next(steps)
            except Exception as exc:
                results.append((request_id, exc))
                self.cancel(request_id)
                continue
            results.append((request_id, step))
            if step.finish_reason is not None:
                self.cancel(request_id)
        return results

    def cancel(self, request_id: Hashable) -> None:
        if self.in_flight is not None:
            raise RuntimeError("cancel() while a step is in flight")
        steps = self._requests.pop(request_id, None)
        if steps is not None:
            steps.close()

    def add_documents(self, documents: Sequence[Sequence[int]]) -> MemoryUsage | None:
        self.decoder.memory_added_on.append(threading.current_thread().name)
        return None if self.memory is None else self.memory.add_documents(documents)

    def memory_usage(self) -> MemoryUsage | None:
        return None if self.memory is None else self.memory.usage()


def token_steps(tokenizer: Any, pieces: Sequence[str]) -> list[list[int]]:
    """One step per text piece, each the piece's token ids."""
    return [tokenizer.encode(piece, add_special_tokens=False) for piece in pieces]


def disconnect_after(chunks: int, disconnect: asyncio.Event) -> Callable[[dict[str, Any]], None]:
    """An ``asgi_post`` ``on_send`` that sets ``disconnect`` (the client leaves) once ``chunks`` non-empty body chunks
    were sent."""
    sent = []

    def on_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])
            if len(sent) == chunks:
                disconnect.set()

    return on_send


async def asgi_post(
    app: Any, path: str, body: dict[str, Any], disconnect: asyncio.Event,
    on_send: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """POST straight through ASGI; the client "disconnects" when ``disconnect`` is set. Returns sent messages.

    (httpx's ASGITransport buffers whole responses and cannot disconnect mid-request.)
    """
    payload = json.dumps(body).encode()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)
        if on_send is not None:
            on_send(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        "client": ("127.0.0.1", 1234), "server": ("testserver", 80), "state": {},
    }
    await app(scope, receive, send)
    return messages


def chat_body(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}], **fields}


def dumps(data: Any) -> str:
    return json.dumps(data)


def gated_loader(decoder: Any) -> tuple[threading.Event, Callable[[Any], Any]]:
    """A ``load_decoder`` that returns ``decoder`` once the returned event is set (at most 30 s): a model still
    loading, for as long as a test needs."""
    release = threading.Event()

    def load(config: Any) -> Any:
        release.wait(30)
        return decoder

    return release, load
