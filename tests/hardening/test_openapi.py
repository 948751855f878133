"""``/openapi.json`` describes the real bodies: what the schema accepts the server parses, what it refuses the
server refuses, the lookahead extension carries the configured maxima, every error status has the envelope."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema_rs
import pytest

from server.app import create_app
from server.config import ServerConfig
from server.errors import BadRequestError, ErrorResponse
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.request_base import SETTINGS_KEY
from server.responses import parse_request

GENERATION_ROUTES = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest"}
PROTOCOL = {"ChatCompletionRequest": ChatCompletionRequest, "CompletionRequest": CompletionRequest}
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
PROMPT = {"prompt": "Hi"}


def document(**overrides: Any) -> dict[str, Any]:
    """The OpenAPI document of an app built with ``overrides`` (no model needed: the lifespan never runs)."""
    config = ServerConfig.model_validate({"warmup": False, **overrides})
    return create_app(config, decoder=object()).openapi()


def validator(doc: dict[str, Any], component: str) -> Any:
    """A JSON-schema validator for one component, its references resolved inside the document."""
    return jsonschema_rs.validator_for({"$ref": f"#/components/schemas/{component}", "components": doc["components"]})


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return document(lookahead={"max_window_size": 6, "max_ngram_size": 5, "max_guess_set_size": 7})


def test_generation_routes_have_request_bodies_and_all_statuses(doc):
    for path, component in GENERATION_ROUTES.items():
        operation = doc["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(component)
        responses = operation["responses"]
        assert set(responses) == {"200", "400", "404", "413", "429", "500", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in ("429", "503"):
            assert "Retry-After" in responses[status]["headers"]
    assert "422" not in str(doc["paths"])  # FastAPI's 422 never leaves the server


def test_lookahead_extension_carries_the_configured_maxima(doc):
    lookahead = doc["components"]["schemas"]["LookaheadRequest"]["properties"]
    ranges = {name: lookahead[name]["anyOf"][0] for name in ("window_size", "ngram_size", "guess_set_size")}
    assert {name: (r["minimum"], r["maximum"]) for name, r in ranges.items()} == {
        "window_size": (1, 6), "ngram_size": (2, 5), "guess_set_size": (0, 7)
    }
    for component in GENERATION_ROUTES.values():
        assert "lookahead" in doc["components"]["schemas"][component]["properties"]


GOOD = [
    CHAT,
    {**CHAT, "model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0, "stop": ["\n", "."], "seed": -1,
     "stream": True, "stream_options": {"include_usage": True}, "lookahead": {"window_size": 6, "enabled": True}},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "assistant", "content": None}, {"role": "user", "content": "Hi", "name": "x"}]},
    {**CHAT, "n": 1, "presence_penalty": 0, "logit_bias": {}, "logprobs": False, "unknown_field": [1, 2]},
    {**CHAT, "presence_penalty": -2, "frequency_penalty": 1.5, "logit_bias": {"1": 2.0, "7": -100},
     "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 3, "ignore_eos": True, "top_p": 0,
     "stop": [f"s{i}" for i in range(16)]},
    {**CHAT, "logprobs": True, "top_logprobs": 20},
    {**CHAT, "tools": [], "tool_choice": "auto", "response_format": {"type": "text"}},
    {**CHAT, "add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": True}},
    {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}},
    {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
     "parallel_tool_calls": False},
    {**CHAT, "tools": [{"type": "function", "function": {"name": "get-x_1", "description": "d", "strict": True,
                                                         "parameters": {"type": "object"}}}],
     "tool_choice": {"type": "function", "function": {"name": "get-x_1"}}},
    {"messages": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "content": "42", "tool_call_id": "call_1"}]},
]
BAD = [
    {},
    {"messages": []},
    {"messages": [{"role": "tool", "content": "x"}]},
    {**CHAT, "temperature": 2.5},
    {**CHAT, "max_tokens": 0},
    {**CHAT, "max_tokens": "8"},
    {**CHAT, "stop": [f"s{i}" for i in range(17)]},
    {**CHAT, "stop": [""]},
    {**CHAT, "seed": 2**63},
    {**CHAT, "n": 9},
    {**CHAT, "model": "gpt-4o"},
    {**CHAT, "logit_bias": {"1": 101}},
    {**CHAT, "logit_bias": {"x": 1}},
    {**CHAT, "presence_penalty": 2.5},
    {**CHAT, "frequency_penalty": -2.5},
    {**CHAT, "min_p": 1.5},
    {**CHAT, "repetition_penalty": 0},
    {**CHAT, "min_tokens": -1},
    {**CHAT, "top_p": -0.1},
    {**CHAT, "lookahead": {"window_size": 7}},
    {**CHAT, "lookahead": {"ngram_size": 1}},
    {**CHAT, "lookahead": {"enabled": "yes"}},
    {"messages": [{"role": "user", "content": None}]},
    {"messages": [{"role": "system"}]},
    {**CHAT, "logprobs": True, "top_logprobs": 21},
    {**CHAT, "top_logprobs": 2},
    {**CHAT, "logprobs": False, "top_logprobs": 2},
    {**CHAT, "response_format": {"type": "json_schema"}},
    {**CHAT, "response_format": {"type": "json_schema", "json_schema": None}},
    {**CHAT, "tools": [{"type": "function", "function": {"name": "has space"}}]},
    {**CHAT, "tools": [{"type": "retrieval"}]},
    {**CHAT, "tool_choice": "required"},
    {**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}},
    {**CHAT, "tool_choice": "sometimes"},
    {**CHAT, "parallel_tool_calls": "yes"},
    {"messages": [{"role": "function", "content": "x", "name": "f"}]},
    {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "has space"}}},
    {**CHAT, "logprobs": True, "top_logprobs": -1},
    {**CHAT, "continue_final_message": True},
    {**CHAT, "chat_template_kwargs": [1]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "input_audio", "text": "x"}]}]},
]


@pytest.mark.parametrize("body", GOOD)
def test_schema_accepts_what_the_server_parses(doc, body):
    assert validator(doc, "ChatCompletionRequest").is_valid(body)
    ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize("body", BAD)
def test_schema_refuses_what_the_server_refuses(doc, body):
    assert not validator(doc, "ChatCompletionRequest").is_valid(body)


@pytest.mark.parametrize("body, valid", [
    (PROMPT, True), ({"prompt": [1, 2, 3]}, True), ({"prompt": ["one"]}, True), ({**PROMPT, "echo": False}, True),
    ({**PROMPT, "echo": True}, True), ({**PROMPT, "n": 2, "best_of": 2}, True), ({**PROMPT, "suffix": "x"}, False),
    ({**PROMPT, "best_of": 9}, False), ({**PROMPT, "n": 8}, True), ({**PROMPT, "n": 9}, False),
    ({**PROMPT, "logprobs": 1}, True), ({**PROMPT, "logprobs": 21}, False), ({**PROMPT, "logprobs": -1}, False),
    ({"prompt": 5}, False), ({}, False), ({"prompt": ""}, False),
    ({"prompt": []}, False), ({"prompt": ["a", "b"]}, True), ({"prompt": [-1]}, False),
    ({"prompt": [[1, 2], [3]]}, True), ({"prompt": [[1], []]}, False), ({"prompt": ["a", ""]}, False),
    ({"prompt": ["a", 1]}, False), ({"prompt": [[]]}, False),
    ({**PROMPT, "max_tokens": 0, "echo": True}, True), ({**PROMPT, "max_tokens": 0}, False),
    ({**PROMPT, "max_tokens": 0, "echo": False}, False), ({**PROMPT, "echo": True, "logprobs": 1}, True),
])
def test_completion_schema(doc, body, valid):
    assert validator(doc, "CompletionRequest").is_valid(body) is valid


def test_error_statuses_use_the_envelope(doc):
    envelope = validator(doc, "ErrorResponse")
    assert envelope.is_valid({"error": {"message": "m", "type": "t", "param": None, "code": None}})
    assert not envelope.is_valid({"error": "m"})
    assert not envelope.is_valid({"detail": [{"msg": "m"}]})
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")) and not (path == "/health" and status == "503"):
                    assert response["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse"), (
                        path, method, status)


def test_auth_is_documented_only_where_enforced():
    open_doc = document()
    assert "securitySchemes" not in open_doc["components"]
    assert all("401" not in op["responses"] for methods in open_doc["paths"].values() for op in methods.values())
    guarded = document(api_key="k", protect_metrics=True)
    assert guarded["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model_id}", "/metrics",
                 "/tokenize", "/detokenize", "/v1/responses", "/v1/responses/{response_id}", "/v1/memory/corpus",
                 "/v1/memory"):
        operation = next(iter(guarded["paths"][path].values()))
        assert "401" in operation["responses"] and operation["security"] == [{"bearer": []}], path
    assert "401" not in guarded["paths"]["/health"]["get"]["responses"]


def test_token_ids_are_bounded_by_the_vocabulary_once_known():
    config = ServerConfig(warmup=False)
    app = create_app(config, decoder=object())
    runtime = app.state.runtime
    assert "maximum" not in str(app.openapi()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"])
    runtime.vocab_size = lambda: 100  # as if the model had loaded (the document is cached only from then on)
    app.openapi_schema = None
    from server.openapi import install_openapi

    install_openapi(app, config, runtime.vocab_size)
    ids = app.openapi()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"][2]
    assert ids["items"] == {"type": "integer", "minimum": 0, "maximum": 99}
    assert app.openapi() is app.openapi()


@pytest.mark.parametrize("body, valid", [
    (PROMPT, True), ({**PROMPT, "add_special_tokens": False}, True), (CHAT, True),
    ({**CHAT, "add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1}}, True),
    ({}, False), ({**PROMPT, **CHAT}, False), ({**PROMPT, "unknown": 1}, False), ({"prompt": 5}, False),
    ({**CHAT, "continue_final_message": True}, False), ({"messages": []}, False),
])
def test_tokenize_schema(doc, body, valid):
    assert validator(doc, "TokenizeRequest").is_valid(body) is valid
    assert set(doc["paths"]["/tokenize"]["post"]["responses"]) == {"200", "400", "404", "413", "500", "503"}
    assert doc["paths"]["/tokenize"]["post"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"].endswith("TokenizeResponse")


@pytest.mark.parametrize("body, valid", [
    ({"tokens": [0, 5]}, True), ({"tokens": []}, True), ({"tokens": [-1]}, False), ({"tokens": ["1"]}, False),
    ({}, False), ({"tokens": [1], "extra": True}, False),
])
def test_detokenize_schema(doc, body, valid):
    assert validator(doc, "DetokenizeRequest").is_valid(body) is valid
    response = doc["paths"]["/detokenize"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert response["$ref"].endswith("DetokenizeResponse")


@pytest.mark.parametrize("prediction, valid", [
    ({"type": "content", "content": "def f(): pass"}, True),
    ({"type": "content", "content": [{"type": "text", "text": "def f(): pass"}]}, True),
    ({"type": "text", "content": "x"}, False), ({"type": "content"}, False), ({"content": "x"}, False),
    ({"type": "content", "content": 3}, False), ("x", False),
])
def test_prediction_schema(doc, prediction, valid):
    for component, body in (("ChatCompletionRequest", CHAT), ("CompletionRequest", PROMPT)):
        assert validator(doc, component).is_valid({**body, "prediction": prediction}) is valid
        if valid:
            PROTOCOL[component].model_validate({**body, "prediction": prediction})


def test_usage_describes_the_prediction_counts(doc):
    details = doc["components"]["schemas"]["CompletionTokensDetails"]["properties"]
    assert set(details) == {"accepted_prediction_tokens", "rejected_prediction_tokens"}


@pytest.mark.parametrize("body, valid", [
    ({"input": "Hi"}, True), ({"input": []}, True), ({"input": [{"role": "user", "content": "Hi"}]}, True),
    ({"input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "x"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "status": "completed"},
                {"type": "function_call_output", "call_id": "c", "output": "42"}],
      "instructions": "Be brief.", "max_output_tokens": 16, "temperature": 0, "top_p": 1, "seed": -1,
      "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}],
      "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False, "stream": True,
      "store": False, "previous_response_id": "resp_x", "metadata": {"k": "v"}, "lookahead": {"window_size": 6},
      "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
      "reasoning": {"effort": "low"}, "include": [], "truncation": "auto"}, True),
    ({}, False), ({"input": 3}, False), ({"input": [{"type": "input_image", "image_url": "x"}]}, False),
    ({"input": [{"role": "tool", "content": "x"}]}, False), ({"input": [{"role": "user"}]}, False),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, False),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, False),
    ({"input": "Hi", "max_output_tokens": 0}, False), ({"input": "Hi", "temperature": 2.5}, False),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, False), ({"input": "Hi", "tool_choice": "sometimes"}, False),
    ({"input": "Hi", "model": "gpt-4o"}, False), ({"input": "Hi", "lookahead": {"window_size": 7}}, False),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, False), ({"input": "Hi", "store": "yes"}, False),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, False),
])
def test_responses_schema(doc, body, valid):
    assert validator(doc, "ResponseRequest").is_valid(body) is valid
    if valid:
        parse_request(body)
    assert set(doc["paths"]["/v1/responses"]["post"]["responses"]) == {
        "200", "400", "404", "413", "429", "500", "503"}


@pytest.mark.parametrize("body, valid", [
    ({"documents": ["def f(): pass"]}, True), ({"documents": ["a", "b"]}, True), ({}, False),
    ({"documents": []}, False), ({"documents": [""]}, False), ({"documents": "a"}, False),
    ({"documents": [1]}, False), ({"documents": ["a"], "text": "b"}, False),
])
def test_memory_corpus_schema(doc, body, valid):
    assert validator(doc, "CorpusRequest").is_valid(body) is valid
    operation = doc["paths"]["/v1/memory/corpus"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("CorpusRequest")
    assert set(operation["responses"]) == {"200", "400", "413", "500", "503"}
    assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("CorpusAdded")
    memory = doc["paths"]["/v1/memory"]["get"]["responses"]
    assert set(memory) == {"200", "500", "503"} and memory["200"]["content"]["application/json"]["schema"][
        "$ref"].endswith("MemoryInfo")


def test_the_settings_are_filled_in_and_the_envelope_is_the_error_model(doc):
    assert SETTINGS_KEY not in json.dumps(doc)  # every marker of protocol.configured became its value
    envelope = doc["components"]["schemas"]["ErrorResponse"]
    assert envelope["properties"]["error"] == {"$ref": "#/components/schemas/ErrorDetail"}
    body = BadRequestError("m", param="p").body()
    assert validator(doc, "ErrorResponse").is_valid(body) and ErrorResponse.model_validate(body).error.param == "p"
    assert "HTTPValidationError" not in doc["components"]["schemas"]


async def test_openapi_json_is_served_and_docs_pages_are_off():
    app = create_app(ServerConfig(warmup=False), decoder=object())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        served = await client.get("/openapi.json")
        assert served.status_code == 200 and served.json()["paths"]["/v1/chat/completions"]["post"]["responses"]
        for page in ("/docs", "/redoc"):
            missing = await client.get(page)
            assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
