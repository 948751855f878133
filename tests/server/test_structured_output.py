"""Structured output over HTTP on the real default model: ``response_format`` is enforced, lookahead or not."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import make_config
from tests.server.helpers import chat_body, running_app, sse_events

pytestmark = pytest.mark.real_model
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
                   "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
ASK = "Give the capital of France as JSON."


@pytest.fixture
async def client(decoder):
    async with running_app(make_config(), decoder) as (_, client):
        yield client


async def chat(client, **fields) -> dict:
    response = await client.post("/v1/chat/completions", json=chat_body(ASK, temperature=0, **fields))
    assert response.status_code == 200, response.text
    return response.json()


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": schema}}


async def test_a_json_schema_is_followed_with_and_without_lookahead(client):
    answers = [await chat(client, max_tokens=64, response_format=json_schema(CITY), lookahead={"enabled": enabled})
               for enabled in (True, False)]
    assert answers[0]["choices"] == answers[1]["choices"]
    choice = answers[0]["choices"][0]
    assert choice["finish_reason"] == "stop"
    document = json.loads(choice["message"]["content"])
    assert set(document) == {"city", "country", "population"} and isinstance(document["population"], int)


async def test_json_object_returns_an_object_and_text_does_not(client):
    plain = (await chat(client, max_tokens=24))["choices"][0]["message"]["content"]
    constrained = (await chat(client, max_tokens=48, response_format={"type": "json_object"}))["choices"][0]
    assert constrained["message"]["content"].startswith("{") and not plain.startswith("{")


async def test_a_streamed_constrained_answer_equals_the_whole_one(client):
    fields = {"max_tokens": 64, "response_format": json_schema(CITY)}
    whole = (await chat(client, **fields))["choices"][0]["message"]["content"]
    response = await client.post("/v1/chat/completions", json=chat_body(ASK, temperature=0, stream=True, **fields))
    chunks = [json.loads(event) for event in sse_events(response.text) if event != "[DONE]"]
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"]) == whole
