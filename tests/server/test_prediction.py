"""Predicted outputs over HTTP, on the real default model: same text, usage details, typed 400s."""

from __future__ import annotations

import pytest

from tests.server.conftest import make_config
from tests.server.helpers import chat_body, running_app

pytestmark = pytest.mark.real_model
GREEDY = {"temperature": 0, "max_tokens": 48}
CODE = "def add(first_number, second_number):\n    return first_number + second_number\n"
ASK = "Repeat this code exactly:\n\n" + CODE


@pytest.fixture
async def client(decoder):
    async with running_app(make_config(), decoder) as (_, client):
        yield client


async def chat(client, **fields) -> dict:
    response = await client.post("/v1/chat/completions", json=chat_body(ASK, **GREEDY, **fields))
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_prediction_keeps_the_text_and_reports_its_tokens(client, tokenizer):
    plain = await chat(client)
    assert "completion_tokens_details" not in plain["usage"]
    text = plain["choices"][0]["message"]["content"]
    predicted = await chat(client, prediction={"type": "content", "content": text})
    assert predicted["choices"][0]["message"]["content"] == text
    details = predicted["usage"]["completion_tokens_details"]
    offered = len(tokenizer(text, add_special_tokens=False).input_ids)
    assert details["accepted_prediction_tokens"] > 0
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == offered
    assert predicted["decoding"]["steps"] < plain["decoding"]["steps"]


async def test_text_parts_and_a_wrong_prediction_change_nothing_but_speed(client):
    plain = await chat(client)
    parts = [{"type": "text", "text": "def mul(a, b):\n"}, {"type": "text", "text": "    return a * b\n"}]
    wrong = await chat(client, prediction={"type": "content", "content": parts})
    assert wrong["choices"] == plain["choices"]
    assert wrong["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] >= 0


async def test_without_lookahead_a_prediction_is_accepted_and_ignored(client):
    off = {"lookahead": {"enabled": False}}
    plain = await chat(client, **off)
    predicted = await chat(client, prediction={"type": "content", "content": CODE}, **off)
    assert predicted["choices"] == plain["choices"]
    assert predicted["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0


async def test_completions_accept_a_prediction(client):
    body = {"prompt": CODE, "temperature": 0, "max_tokens": 16}
    plain = (await client.post("/v1/completions", json=body)).json()
    predicted = await client.post("/v1/completions", json={**body, "prediction": {"type": "content", "content": CODE}})
    assert predicted.status_code == 200
    assert predicted.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    assert "completion_tokens_details" in predicted.json()["usage"]


@pytest.mark.parametrize(
    "prediction, param",
    [
        ({"type": "text", "content": "x"}, "prediction.type"),
        ({"content": "x"}, "prediction.type"),
        ({"type": "content", "content": 3}, "prediction.content"),
        ({"type": "content"}, "prediction.content"),
        ("just text", "prediction"),
    ],
)
async def test_bad_predictions_are_400s_naming_the_field(client, prediction, param):
    response = await client.post("/v1/chat/completions", json=chat_body(ASK, prediction=prediction))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
