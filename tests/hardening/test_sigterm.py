"""SIGTERM with requests in flight, on a live server of its own (tests/e2e covers one stream that finishes):
a short non-streamed request finishes within the grace period, new requests and ``/health`` get 503 at once, a
stream too long for the grace period is cancelled with an error event when it ends, and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.e2e.conftest import start_server
from tests.hardening.live import (
    COUNTING,
    RUNNING,
    assert_envelope,
    completion_body,
    rejected,
    samples_of,
    wait_metric,
)

pytestmark = pytest.mark.real_model
GRACE_SECONDS = 6.0
SHORT_TOKENS = 10


async def read_stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> list[str]:
    """All data events of a stream; ``started`` is set at the first one."""
    events: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append(line[len("data:"):].strip())
                started.set()
    return events


async def test_sigterm_finishes_short_work_refuses_new_cancels_long_and_exits_zero(tmp_path):
    server = start_server(tmp_path / "sigterm.log", "--no-warmup", "--max-running", "2",
                          "--drain-grace-seconds", str(GRACE_SECONDS))
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            started = asyncio.Event()
            long = asyncio.create_task(read_stream(client, completion_body(max_tokens=2000, stream=True), started))
            await asyncio.wait_for(started.wait(), 60)
            short = asyncio.create_task(client.post("/v1/completions", json=completion_body(max_tokens=SHORT_TOKENS)))
            await wait_metric(server.base_url, lambda s: s[RUNNING] == 2, what="both requests running")

            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            while (await client.get("/health")).status_code != 503:
                assert time.monotonic() - signalled < 5, "health still 200 after SIGTERM"
                await asyncio.sleep(0.05)
            refused = await client.post("/v1/completions", json=completion_body(COUNTING, max_tokens=2))
            error = assert_envelope(refused, 503)
            assert error["code"] == "service_unavailable" and refused.headers["retry-after"] == "1"
            draining = samples_of((await client.get("/metrics")).text)
            assert draining[rejected("draining")] == 1

            finished = await short
            assert finished.status_code == 200, finished.text
            assert finished.json()["usage"]["completion_tokens"] == SHORT_TOKENS
            assert time.monotonic() - signalled < GRACE_SECONDS

            events = await asyncio.wait_for(long, GRACE_SECONDS + 30)
            assert "[DONE]" not in events
            assert json.loads(events[-1])["error"]["code"] == "service_unavailable"
        assert server.process.wait(GRACE_SECONDS + 30) == 0, server.log()[-3000:]
        log = server.log()
        assert "draining" in log and "cancelling 1 request" in log
        assert "Traceback" not in log, log[-3000:]
    finally:
        server.stop()
