"""Clients that vanish, against the live server: while queued, during the prefill (streamed or not), mid-stream
and during a non-streamed generation. Each must stop its generation (counted as ``abort`` and as a client
disconnect, the running gauge back to 0, no more tokens produced), and the KV memory must be released: after
a warm-up round, the server's resident memory after 35 such clients stays within ``RSS_BOUND`` of its baseline.
The server still gives the same greedy text afterwards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from tests.hardening.conftest import MAX_RUNNING
from tests.hardening.live import (
    ABORTED,
    COUNTING,
    DISCONNECTS,
    WAITING,
    RawClient,
    completion_body,
    delta,
    finished_total,
    rss_bytes,
    scrape,
    wait_idle,
    wait_metric,
)

pytestmark = pytest.mark.real_model
COMPLETIONS = "/v1/completions"
LONG = 200  # max_tokens no vanishing client lives to see
PREFILL_PROMPT = COUNTING * 20  # ~230 tokens: a prefill of about a second on this CPU
RSS_BOUND = 50 * 2**20
ROUNDS = 4  # measured rounds, after one warm-up round


def long_request(stream: bool, prompt: str = COUNTING) -> dict:
    return completion_body(prompt, max_tokens=LONG, stream=stream)


async def mid_stream(base_url: str) -> int:
    """Read three events of a stream, then vanish."""
    client = RawClient(base_url)
    await client.send(COMPLETIONS, long_request(stream=True))
    assert len(await client.read_events(3)) >= 3
    await client.vanish()
    return 1


async def non_stream(base_url: str) -> int:
    """Vanish while a non-streamed generation is producing tokens."""
    before = scrape(base_url)["lookahead_generation_tokens_total"]
    client = RawClient(base_url)
    await client.send(COMPLETIONS, long_request(stream=False))
    await wait_metric(base_url, lambda s: s["lookahead_generation_tokens_total"] >= before + 3, what="tokens")
    await client.vanish()
    return 1


async def in_prefill(base_url: str, stream: bool) -> int:
    """Vanish while the long prompt is being prefilled."""
    client = RawClient(base_url)
    await client.send(COMPLETIONS, long_request(stream, PREFILL_PROMPT))
    await asyncio.sleep(0.3)
    await client.vanish()
    return 1


async def while_queued(base_url: str, stream: bool) -> int:
    """Fill the running slots with streams, vanish from the waiting queue, then from the streams."""
    blockers = [RawClient(base_url) for _ in range(MAX_RUNNING)]
    for blocker in blockers:
        await blocker.send(COMPLETIONS, long_request(stream=True))
        await blocker.read_events(1)
    queued = RawClient(base_url)
    await queued.send(COMPLETIONS, long_request(stream))
    await wait_metric(base_url, lambda s: s[WAITING] >= 1, what="a waiting request")
    await queued.vanish()
    await wait_metric(base_url, lambda s: s[WAITING] == 0, what="the queue freed")
    for blocker in blockers:
        await blocker.vanish()
    return 1 + len(blockers)


SCENARIOS: list[Callable[[str], Awaitable[int]]] = [
    mid_stream,
    non_stream,
    lambda base_url: in_prefill(base_url, stream=True),
    lambda base_url: in_prefill(base_url, stream=False),
    lambda base_url: while_queued(base_url, stream=False),
    lambda base_url: while_queued(base_url, stream=True),
]


async def one_round(base_url: str) -> int:
    """Every scenario once; the number of clients that vanished."""
    vanished = 0
    for scenario in SCENARIOS:
        vanished += await scenario(base_url)
        wait_idle(base_url)
    return vanished


def greedy_text(base_url: str) -> str:
    response = httpx.post(f"{base_url}{COMPLETIONS}", json=completion_body("The capital of France is"), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def settled_rss(pid: int) -> int:
    """Resident memory once it stops moving (a few samples, bounded)."""
    previous = rss_bytes(pid)
    for _ in range(10):
        time.sleep(0.3)
        current = rss_bytes(pid)
        if abs(current - previous) < 2**20:
            return current
        previous = current
    return previous


async def test_vanishing_clients_stop_their_generation_and_release_memory(live):
    reference = greedy_text(live.base_url)
    before = wait_idle(live.base_url)
    vanished = await one_round(live.base_url)  # warm-up: allocator pools reach their working size
    warm = wait_idle(live.base_url)
    assert delta(before, warm, ABORTED) == vanished
    assert delta(before, warm, DISCONNECTS) == vanished
    baseline = settled_rss(live.process.pid)

    for _ in range(ROUNDS):
        vanished += await one_round(live.base_url)
    after = wait_idle(live.base_url)
    time.sleep(0.5)
    later = scrape(live.base_url)
    rss = settled_rss(live.process.pid)

    print(f"RSS baseline {baseline / 2**20:.0f} MiB, after {vanished} vanished clients {rss / 2**20:.0f} MiB")
    assert vanished >= 30
    assert delta(before, after, ABORTED) == vanished  # every vanished client, and only those, aborted
    assert delta(before, after, DISCONNECTS) == vanished
    assert finished_total(after) - finished_total(before) == vanished  # none finished another way
    assert later["lookahead_generation_tokens_total"] == after["lookahead_generation_tokens_total"]  # stopped
    assert after["lookahead_requests_running"] == 0
    assert rss - baseline < RSS_BOUND, f"RSS grew by {(rss - baseline) / 2**20:.1f} MiB after {vanished} clients"
    assert greedy_text(live.base_url) == reference
