"""Helpers for driving a live server on loopback: metrics, resident memory, raw sockets, request bodies.

Everything here talks to 127.0.0.1 only, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from server.sse import data_events

MODEL = "SmolLM2-135M-Instruct"
ERROR_FIELDS = {"message", "type", "param", "code"}
# A prompt whose greedy continuation keeps counting, so a request never ends early on its own.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"


def samples_of(text: str) -> dict[str, float]:
    """Every sample of a Prometheus exposition as ``name{label="v",...}`` -> value (labels sorted)."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def scrape(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """The live server's metrics."""
    response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    return samples_of(response.text)


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much one sample grew between two scrapes."""
    return after.get(name, 0.0) - before.get(name, 0.0)


ABORTED = 'lookahead_requests_total{finish_reason="abort"}'
ERRORED = 'lookahead_requests_total{finish_reason="error"}'
DISCONNECTS = "lookahead_client_disconnects_total"
RUNNING = "lookahead_requests_running"
WAITING = "lookahead_requests_waiting"


def rejected(reason: str) -> str:
    return f'lookahead_requests_rejected_total{{reason="{reason}"}}'


def rejected_total(samples: dict[str, float]) -> float:
    """All refusals, whatever the reason."""
    return sum(value for name, value in samples.items() if name.startswith("lookahead_requests_rejected_total{"))


def finished_total(samples: dict[str, float]) -> float:
    """All finished requests, whatever the finish reason."""
    return sum(value for name, value in samples.items() if name.startswith("lookahead_requests_total{"))


def wait_idle(base_url: str, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits; return that scrape. Fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(base_url)
        if samples.get(RUNNING) == 0 and samples.get(WAITING) == 0:
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: running={samples.get(RUNNING)}")
        time.sleep(0.1)


async def wait_metric(base_url: str, predicate: Any, timeout: float = 60.0, what: str = "metric") -> dict[str, float]:
    """Poll /metrics (without blocking the loop) until ``predicate(samples)``; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            samples = samples_of((await client.get(f"{base_url}/metrics")).text)
            if predicate(samples):
                return samples
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.05)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process."""
    return psutil.Process(pid).memory_info().rss


def assert_envelope(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """The response is an error in OpenAI's envelope (with ``status`` if given); returns its ``error``."""
    if status is not None:
        assert response.status_code == status, response.text[:500]
    assert response.status_code >= 400, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


def completion_body(prompt: str = COUNTING, max_tokens: int = 8, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}


def chat_body(content: str, max_tokens: int = 8, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **fields}


def sse_data(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body (``server.sse``)."""
    return data_events(body)


def stream_text(events: list[str]) -> str:
    """The text of a completions or chat stream (its data payloads)."""
    pieces = []
    for event in events:
        if event == "[DONE]":
            continue
        data = json.loads(event)
        for choice in data.get("choices", []):
            pieces.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(pieces)


class RawClient:
    """One HTTP/1.1 request on its own socket, so a test can vanish at any moment (close without reading)."""

    def __init__(self, base_url: str) -> None:
        host_port = base_url.split("://", 1)[1]
        host, port = host_port.rsplit(":", 1)
        assert host in ("127.0.0.1", "localhost"), "loopback only"
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, path: str, body: dict[str, Any] | bytes) -> None:
        """Open the connection and send a POST with a JSON body."""
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: keep-alive\r\n\r\n"
        )
        self.writer.write(head.encode() + payload)
        await self.writer.drain()

    async def read_events(self, count: int, timeout: float = 60.0) -> list[str]:
        """Read until ``count`` SSE ``data:`` lines arrived (bounded by ``timeout``)."""
        assert self.reader is not None
        events: list[str] = []
        buffer = b""
        deadline = time.monotonic() + timeout
        while len(events) < count:
            chunk = await asyncio.wait_for(self.reader.read(4096), max(deadline - time.monotonic(), 0.01))
            if not chunk:
                break
            buffer += chunk
            events = [line for line in buffer.decode(errors="replace").splitlines() if line.startswith("data:")]
        return events

    async def vanish(self) -> None:
        """Close the socket without reading the rest."""
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
