"""Overload on the live server (2 running slots, 4 waiting places): a burst of concurrent greedy requests gets a
mix of 200s and 429s with ``Retry-After``; every request gets an answer; every accepted request returns the text
it gets alone; the 429s equal the growth of ``lookahead_requests_rejected_total``; retrying after ``Retry-After``
eventually serves every rejected request, with the same text."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.hardening.conftest import MAX_QUEUE, MAX_RUNNING
from tests.hardening.live import (
    assert_envelope,
    chat_body,
    delta,
    finished_total,
    rejected,
    rejected_total,
    scrape,
    sse_data,
    stream_text,
    wait_idle,
)

pytestmark = pytest.mark.real_model
PROMPTS = ("Name a fruit.", "What is 2 + 2?", "Say something about the moon.")
BURST = 16
MAX_TOKENS = 10
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Request:
    """One request of the burst: which prompt, streamed or not, lookahead on or off."""

    prompt: str
    stream: bool
    lookahead: bool

    def body(self) -> dict:
        return chat_body(self.prompt, MAX_TOKENS, stream=self.stream, lookahead={"enabled": self.lookahead})


@dataclass(frozen=True)
class Outcome:
    status: int
    text: str | None
    retry_after: str | None


def burst_requests() -> list[Request]:
    return [Request(PROMPTS[i % 3], stream=i % 2 == 1, lookahead=i % 4 != 3) for i in range(BURST)]


async def send(client: httpx.AsyncClient, request: Request) -> Outcome:
    """Send one request and read its whole answer (stream or not)."""
    async with client.stream("POST", CHAT, json=request.body()) as response:
        await response.aread()
    if response.status_code != 200:
        assert_envelope(response)
        return Outcome(response.status_code, None, response.headers.get("retry-after"))
    if request.stream:
        events = sse_data(response.text)
        assert events[-1] == "[DONE]", events[-3:]
        return Outcome(200, stream_text(events), None)
    return Outcome(200, response.json()["choices"][0]["message"]["content"], None)


async def send_until_served(client: httpx.AsyncClient, request: Request, deadline: float) -> Outcome:
    """Retry after ``Retry-After`` seconds until served (or the deadline passes)."""
    while True:
        outcome = await send(client, request)
        if outcome.status != 429 or time.monotonic() > deadline:
            return outcome
        await asyncio.sleep(float(outcome.retry_after or 1))


async def test_burst_gets_200s_and_429s_and_nothing_is_lost(live):
    limits = httpx.Limits(max_connections=BURST)
    async with httpx.AsyncClient(base_url=live.base_url, timeout=120, limits=limits) as client:
        alone = {}
        for request in {Request(prompt, False, lookahead) for prompt in PROMPTS for lookahead in (True, False)}:
            alone[request.prompt, request.lookahead] = (await send(client, request)).text
        before = wait_idle(live.base_url)
        requests = burst_requests()
        outcomes = await asyncio.wait_for(asyncio.gather(*(send(client, r) for r in requests)), timeout=300)
        after = wait_idle(live.base_url)

        statuses = [outcome.status for outcome in outcomes]
        assert len(outcomes) == BURST and set(statuses) == {200, 429}, statuses  # an answer each; both kinds
        assert statuses.count(200) >= MAX_RUNNING + MAX_QUEUE  # the whole capacity was used
        for request, outcome in zip(requests, outcomes, strict=True):
            if outcome.status == 200:
                assert outcome.text == alone[request.prompt, request.lookahead], request
            else:
                assert outcome.retry_after is not None and int(outcome.retry_after) >= 1
        rejected_now = statuses.count(429)
        assert delta(before, after, rejected("queue_full")) == rejected_now
        assert rejected_total(after) - rejected_total(before) == rejected_now
        assert finished_total(after) - finished_total(before) == statuses.count(200)

        deadline = time.monotonic() + 180
        retried = [request for request, outcome in zip(requests, outcomes, strict=True) if outcome.status == 429]
        second = await asyncio.wait_for(
            asyncio.gather(*(send_until_served(client, r, deadline) for r in retried)), timeout=300
        )
        assert [outcome.status for outcome in second] == [200] * len(retried)
        for request, outcome in zip(retried, second, strict=True):
            assert outcome.text == alone[request.prompt, request.lookahead], request
    final = scrape(live.base_url)
    assert final["lookahead_requests_running"] == 0 and final["lookahead_requests_waiting"] == 0
