"""A seed gives the same text whatever the decoding: lookahead on or off, memory cold or warm, alone or beside other
traffic, streamed or not, choice j of ``n`` or ``seed + j`` alone; an unseeded answer reports the seed that
replays it. The real default model behind the real app, at the server's defaults (the shared memory on)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.server.conftest import make_config
from tests.server.helpers import chat_body, running_app, sse_events

pytestmark = pytest.mark.real_model
CHAT = "/v1/chat/completions"
SAMPLED = {"temperature": 1.0, "max_tokens": 28, "seed": 1234}
QUESTION = "Write a short poem about the sea."


@pytest.fixture
async def client(decoder):
    async with running_app(make_config(), decoder) as (app, client):
        yield app, client


async def chat(client, content: str = QUESTION, **fields) -> dict:
    response = await client.post(CHAT, json=chat_body(content, **{**SAMPLED, **fields}))
    assert response.status_code == 200, response.text
    return response.json()


def texts(data: dict) -> list[str]:
    return [choice["message"]["content"] for choice in data["choices"]]


async def test_identical_seeded_requests_return_identical_texts(client):
    app, client = client
    assert app.state.runtime.config.lookahead.memory_tokens > 0, "the shared memory must be on, as by default"
    first = await chat(client)
    again = [await chat(client) for _ in range(2)]  # the memory now holds the first answer
    assert [texts(data) for data in again] == [texts(first)] * 2
    assert first["decoding"]["method"] == "lookahead" and first["decoding"]["seed"] == 1234
    plain = await chat(client, lookahead={"enabled": False})
    assert plain["decoding"]["method"] == "autoregressive" and texts(plain) == texts(first)
    other = await chat(client, seed=1235)
    assert texts(other) != texts(first)


async def test_a_seeded_request_interleaved_with_other_traffic_returns_the_same_text(client):
    _, client = client
    alone = texts(await chat(client))
    traffic = [chat(client, content, seed=seed) for seed, content in enumerate(
        ["Count from one to twenty.", QUESTION, "Name three colours.", "Write a haiku about rain."])]
    results = await asyncio.gather(chat(client), *traffic, chat(client, max_tokens=28))
    assert texts(results[0]) == alone and texts(results[-1]) == alone


async def test_a_stream_and_choice_j_carry_the_seeded_text(client):
    _, client = client
    whole = await chat(client, n=3)
    choices = texts(whole)
    assert len(set(choices)) > 1
    assert texts(await chat(client, seed=1236)) == [choices[2]]  # choice j samples with seed + j
    response = await client.post(CHAT, json=chat_body(QUESTION, **SAMPLED, stream=True))
    chunks = [json.loads(event) for event in sse_events(response.text)[:-1]]
    streamed = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    assert streamed == choices[0]


async def test_an_unseeded_answer_reports_the_seed_that_replays_it(client):
    _, client = client
    unseeded = {**SAMPLED}
    del unseeded["seed"]
    response = await client.post(CHAT, json=chat_body(QUESTION, **unseeded))
    data = response.json()
    seed = data["decoding"]["seed"]
    assert isinstance(seed, int) and -(2**63) <= seed < 2**63
    assert texts(await chat(client, seed=seed)) == texts(data)
    greedy = await chat(client, temperature=0, max_tokens=4)
    assert greedy["decoding"]["seed"] is None
