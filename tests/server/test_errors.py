"""Every error the API can return: status, OpenAI envelope, param and code. Never a 422, never a stray 500."""

from __future__ import annotations

import pytest

from tests.server.conftest import make_config
from tests.server.helpers import chat_body, running_app, scrape

pytestmark = pytest.mark.real_model
CHAT = "/v1/chat/completions"


@pytest.fixture
async def app_client(decoder):
    async with running_app(make_config(max_request_bytes=4096), decoder) as (app, client):
        yield app, client


@pytest.fixture
def client(app_client):
    return app_client[1]


def assert_error(response, status: int, param=None, code=None, error_type="invalid_request_error"):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == error_type
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


async def test_invalid_json(client):
    response = await client.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(response, 400)


async def test_body_must_be_an_object(client):
    assert_error(await client.post(CHAT, json=[1, 2]), 400)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 8.5}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stream": "yes"}, "stream"),
        ({"seed": "1"}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
        ({"lookahead": {"window_size": 999}}, "lookahead.window_size"),
        ({"lookahead": {"ngram_size": 1}}, "lookahead.ngram_size"),
        ({"lookahead": {"guess_set_size": -1}}, "lookahead.guess_set_size"),
        ({"lookahead": {"window_size": "3"}}, "lookahead.window_size"),
        ({"lookahead": {"enabled": "no"}}, "lookahead.enabled"),
        ({"lookahead": {"shared_memory": "no"}}, "lookahead.shared_memory"),
        ({"lookahead": {"shared_memory": 0}}, "lookahead.shared_memory"),
        ({"n": 9}, "n"),  # over max_n (8 by default)
        ({"n": 0}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logit_bias": {"42": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
        ({"max_tokens": 8192}, "max_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
          "function": {"name": "g"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces"}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
         "response_format.json_schema.schema"),
    ],
)
async def test_bad_generation_fields(client, fields, param):
    assert_error(await client.post(CHAT, json=chat_body("Hi", **fields)), 400, param=param)


@pytest.mark.parametrize(
    "fields",
    [{"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"response_format": {"type": "text"}},
     {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}],
)
async def test_neutral_tool_and_format_fields_are_accepted(client, fields):
    response = await client.post(CHAT, json=chat_body("Hi", max_tokens=2, **fields))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "messages, param",
    [
        (None, "messages"),
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "wizard", "content": "Hi"}], "messages[0].role"),
        ([{"content": "Hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"}], "messages[1].tool_call_id"),
        ([{"role": "tool", "tool_call_id": "c"}], "messages[0].content"),
        ([{"role": "tool", "content": "42", "tool_call_id": ""}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": "Hi", "tool_calls": []}, {"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "{}"}}]}], "messages[1].tool_calls"),
        ([5], "messages[0]"),
        ([{"role": "function", "content": "x", "name": "f"}], "messages[0].role"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}],
         "messages[0].tool_calls[0].function.arguments"),
    ],
)
async def test_bad_messages(client, messages, param):
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 2}
    if messages is not None:
        body["messages"] = messages
    assert_error(await client.post(CHAT, json=body), 400, param=param)


async def test_context_length_exceeded(client):
    error = assert_error(await client.post(CHAT, json=chat_body("Hi", max_tokens=8190)), 400, param="max_tokens")
    assert error["code"] == "context_length_exceeded" and "8192" in error["message"]


async def test_prompt_alone_over_the_context(decoder):
    async with running_app(make_config(), decoder) as (_, client):
        response = await client.post("/v1/completions", json={"prompt": list(range(100, 100 + 8192)), "max_tokens": 1})
        assert_error(response, 400, param="prompt", code="context_length_exceeded")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt[1]"),
        ({"prompt": ["a", 1]}, "prompt[1]"),
        ({"prompt": [[1, 2], []]}, "prompt[1]"),
        ({"prompt": [[1, True]]}, "prompt[0][1]"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": [[5], [10**9]]}, "prompt[1]"),
        ({"prompt": ["a"] * 25, "n": 2}, "prompt"),  # 50 sequences: more than 16 running + 32 waiting
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
        ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({}, "prompt"),
    ],
)
async def test_bad_completion_requests(client, fields, param):
    assert_error(await client.post("/v1/completions", json={"max_tokens": 2, **fields}), 400, param=param)


async def test_unknown_model_is_404(client):
    error = assert_error(await client.post(CHAT, json={**chat_body("Hi"), "model": "gpt-4o"}), 404, param="model")
    assert error["code"] == "model_not_found"
    response = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert_error(response, 404, param="model", code="model_not_found")


async def test_body_too_large(client):
    body = chat_body("x" * 5000, max_tokens=2)
    assert_error(await client.post(CHAT, json=body), 413, code="request_too_large")


async def test_unknown_route_and_method_use_the_envelope(client):
    assert_error(await client.get("/v1/nothing"), 404)
    assert_error(await client.get(CHAT), 405)


async def test_rejections_are_counted(app_client):
    app, client = app_client
    await client.post(CHAT, json=chat_body("Hi", temperature=3))
    await client.post(CHAT, json={**chat_body("Hi"), "model": "other"})
    samples = scrape(app)
    assert samples['lookahead_requests_rejected_total{reason="invalid_request"}'] == 1
    assert samples['lookahead_requests_rejected_total{reason="model_not_found"}'] == 1
    assert samples['lookahead_requests_total{finish_reason="error"}'] == 0


async def test_api_key(decoder):
    async with running_app(make_config(api_key="s3cret"), decoder) as (_, client):
        missing = await client.get("/v1/models")
        assert_error(missing, 401, code="invalid_api_key")
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401, code="invalid_api_key")
        basic = await client.get("/v1/models", headers={"Authorization": "Basic s3cret"})
        assert_error(basic, 401, code="invalid_api_key")
        chat = await client.post(CHAT, json=chat_body("Hi", max_tokens=2))
        assert_error(chat, 401, code="invalid_api_key")
        ok = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


TEXT_PART = {"type": "text", "text": "Describe this."}


@pytest.mark.parametrize("part, param, says", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "messages[0].content[1].type",
     "image_url content parts are not supported"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "messages[0].content[1].type",
     "input_audio content parts are not supported"),
    ({"type": "file", "file": {"file_id": "f"}}, "messages[0].content[1].type", "file content parts"),
    ({"type": "video"}, "messages[0].content[1].type", "unknown content part type 'video'"),
    ({"type": 5, "text": "x"}, "messages[0].content[1].type", "valid string"),
    ({"type": "text"}, "messages[0].content[1].text", "field required"),
])
async def test_media_content_parts_are_refused_by_name(client, part, param, says):
    for path in (CHAT, "/tokenize"):
        response = await client.post(path, json={"messages": [{"role": "user", "content": [TEXT_PART, part]}]})
        error = assert_error(response, 400, param=param)
        assert says in error["message"], error["message"]


async def test_text_parts_are_concatenated(client):
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo there"}]
    split = await client.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]})
    whole = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello there"}]})
    assert split.status_code == 200 and split.json() == whole.json()
