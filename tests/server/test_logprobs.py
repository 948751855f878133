"""Logprobs through the HTTP API on the real default model: chat's ``choices[].logprobs.content`` (read with the
official ``openai`` SDK), equal to the autoregressive decode's; stream chunks that reassemble to the same list;
the legacy completions shape."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import make_config
from tests.server.helpers import chat_body, running_app, sse_events

pytestmark = pytest.mark.real_model
TOLERANCE = 1e-4
REPEAT = "Write a Python function that adds two numbers."  # lookahead accepts guesses on this one
LOGPROBS = {"temperature": 0, "max_tokens": 40, "logprobs": True, "top_logprobs": 5}
AUTOREGRESSIVE = {"lookahead": {"enabled": False}}


@pytest.fixture
async def client(decoder):
    async with running_app(make_config(), decoder) as (_, client):
        yield client


def sdk(client: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """The official SDK over the in-process app."""
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)


def assert_same_content(actual: list[dict], expected: list[dict]) -> None:
    assert [entry["token"] for entry in actual] == [entry["token"] for entry in expected]
    for mine, reference in zip(actual, expected, strict=True):
        assert mine["logprob"] == pytest.approx(reference["logprob"], abs=TOLERANCE)
        assert [top["token"] for top in mine["top_logprobs"]] == [top["token"] for top in reference["top_logprobs"]]
        assert [top["logprob"] for top in mine["top_logprobs"]] == pytest.approx(
            [top["logprob"] for top in reference["top_logprobs"]], abs=TOLERANCE
        )


async def test_chat_logprobs_shape_and_values_equal_autoregressive(client):
    api = sdk(client)
    messages = [{"role": "user", "content": REPEAT}]
    lookahead = await api.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
                                                  max_tokens=40, logprobs=True, top_logprobs=5)
    reference = await api.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
                                                  max_tokens=40, logprobs=True, top_logprobs=5,
                                                  extra_body=AUTOREGRESSIVE)
    [choice] = lookahead.choices
    content = choice.logprobs.content
    assert len(content) == lookahead.usage.completion_tokens
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 5 and entry.top_logprobs[0].token == entry.token  # greedy: the best
        assert all(top.bytes == list(top.token.encode("utf-8")) for top in entry.top_logprobs)
    decoding = lookahead.model_extra["decoding"]
    assert decoding["method"] == "lookahead" and decoding["accepted_tokens"] > 0  # multi-token steps happened
    assert reference.model_extra["decoding"]["method"] == "autoregressive"
    assert choice.message.content == reference.choices[0].message.content
    assert_same_content([entry.model_dump() for entry in content],
                        [entry.model_dump() for entry in reference.choices[0].logprobs.content])


async def test_chat_stream_logprobs_reassemble_to_the_non_stream_list(client):
    body = chat_body(REPEAT, **LOGPROBS)
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    events = sse_events((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)
    chunks = [json.loads(event) for event in events[:-1]]
    content_chunks = [chunk for chunk in chunks if chunk["choices"][0]["logprobs"] is not None]
    assert len(content_chunks) > 1 and all("content" in c["choices"][0]["delta"] for c in content_chunks)
    assert chunks[0]["choices"][0]["logprobs"] is None and chunks[-1]["choices"][0]["logprobs"] is None
    streamed = [entry for chunk in content_chunks for entry in chunk["choices"][0]["logprobs"]["content"]]
    assert_same_content(streamed, whole["choices"][0]["logprobs"]["content"])
    for chunk in content_chunks:  # each chunk's logprobs are its own delta's tokens
        text = "".join(entry["token"] for entry in chunk["choices"][0]["logprobs"]["content"])
        assert text == chunk["choices"][0]["delta"]["content"]


async def test_chat_without_logprobs_has_null_logprobs(client):
    data = (await client.post("/v1/chat/completions", json=chat_body("Hi", temperature=0, max_tokens=4))).json()
    assert data["choices"][0]["logprobs"] is None
    zero = chat_body("Hi", temperature=0, max_tokens=4, logprobs=True)
    content = (await client.post("/v1/chat/completions", json=zero)).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(entry["top_logprobs"] == [] for entry in content)


async def test_completions_legacy_logprobs_shape_and_stream(client):
    body = {"prompt": REPEAT, "temperature": 0, "max_tokens": 24, "logprobs": 3}
    data = (await client.post("/v1/completions", json=body)).json()
    [choice] = data["choices"]
    logprobs = choice["logprobs"]
    assert logprobs.keys() == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    tokens = logprobs["tokens"]
    assert len(tokens) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 24
    assert "".join(tokens) == choice["text"]
    assert logprobs["text_offset"] == [sum(len(token) for token in tokens[:i]) for i in range(len(tokens))]
    for token, value, top in zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        assert 1 <= len(top) <= 3 and top[token] == pytest.approx(value) and max(top.values()) == top[token]
    reference = (await client.post("/v1/completions", json={**body, **AUTOREGRESSIVE})).json()["choices"][0]
    assert reference["logprobs"]["tokens"] == tokens
    assert reference["logprobs"]["token_logprobs"] == pytest.approx(logprobs["token_logprobs"], abs=TOLERANCE)
    events = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
    pieces = [json.loads(event)["choices"][0]["logprobs"] for event in events[:-1]]
    pieces = [piece for piece in pieces if piece is not None]
    assert [value for piece in pieces for value in piece["text_offset"]] == logprobs["text_offset"]
    assert [token for piece in pieces for token in piece["tokens"]] == tokens


async def test_a_generated_eos_is_listed_in_logprobs_and_counted_in_usage(client, tokenizer):
    """lm-evaluation-harness' loglikelihood request (``max_tokens`` 1, ``echo``, ``logprobs`` 1) drops the last
    logprob entry as the generated token: when the model generates EOS, that entry must be EOS's, and it counts."""
    eos = tokenizer.eos_token_id
    body = {"prompt": "The capital of France is Paris.", "max_tokens": 1, "echo": True, "logprobs": 1,
            "temperature": 0, "logit_bias": {str(eos): 100}}
    data = (await client.post("/v1/completions", json=body)).json()
    [choice] = data["choices"]
    prompt_tokens = data["usage"]["prompt_tokens"]
    assert choice["finish_reason"] == "stop" and choice["text"] == body["prompt"]  # EOS's text stays out
    assert data["usage"]["completion_tokens"] == 1
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == prompt_tokens + 1
    assert logprobs["tokens"][-1] == tokenizer.eos_token
    assert -30 < logprobs["token_logprobs"][-1] < 0  # the raw model's logprob: the bias chose EOS, it is not in it
    assert logprobs["text_offset"][-1] == len(body["prompt"])
    events = sse_events((await client.post("/v1/completions", json={**body, "stream": True,
                                                                     "stream_options": {"include_usage": True}})).text)
    chunks = [json.loads(event) for event in events[:-1]]
    streamed = [token for chunk in chunks if chunk["choices"] and chunk["choices"][0]["logprobs"]
                for token in chunk["choices"][0]["logprobs"]["tokens"]]
    assert streamed == logprobs["tokens"] and chunks[-1]["usage"]["completion_tokens"] == 1


async def test_chat_lists_the_eos_it_ends_with(client, tokenizer):
    body = chat_body("Say hi.", temperature=0, max_tokens=64, logprobs=True)
    data = (await client.post("/v1/chat/completions", json=body)).json()
    [choice] = data["choices"]
    assert choice["finish_reason"] == "stop"
    content = choice["logprobs"]["content"]
    assert content[-1]["token"] == tokenizer.eos_token and len(content) == data["usage"]["completion_tokens"]
    assert "".join(entry["token"] for entry in content[:-1]) == choice["message"]["content"]
