"""Structured output on the real default model: ``response_format`` is enforced, lookahead or not; objects close
(OpenAI's strict rules under ``strict``) and JSON numbers have llama.cpp's digit bounds, configurable."""

from __future__ import annotations

import json

import pytest

from decoding import Grammar
from server import tools
from server.protocol import ChatCompletionRequest
from server.serving import response_grammar
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


# --- schemas that close, numbers that end -----------------------------------------------------------------------

UNSAID = {  # says nothing of additionalProperties; "country" is optional
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
                   "population_millions": {"type": "number"}},
    "required": ["city", "population_millions"],
}
EXTRA_KEY = '{"city": "Paris", "country": "France", "population_millions": 2.1, "population_density": 5}'


def request_grammar(response_format: dict) -> Grammar:
    return response_grammar(ChatCompletionRequest.model_validate(chat_body(ASK, response_format=response_format))
                            .response_format)


def allowed_prefix(decoder, grammar: Grammar, text: str) -> str:
    """The longest prefix of ``text``'s tokens that ``grammar`` allows, as text."""
    ids = decoder.tokenizer.encode(text, add_special_tokens=False)
    return decoder.tokenizer.decode(ids[: decoder.grammars.constraint(grammar).valid_prefix(ids)])


@pytest.mark.parametrize("strict", [False, True])
def test_an_object_that_does_not_open_itself_takes_only_its_keys(decoder, strict):
    closed = request_grammar(json_schema(UNSAID) | {"json_schema": {"name": "c", "strict": strict, "schema": UNSAID}})
    assert allowed_prefix(decoder, closed, EXTRA_KEY) == EXTRA_KEY[: EXTRA_KEY.index(', "population_density')]
    opened = request_grammar(json_schema(UNSAID | {"additionalProperties": True}))
    assert allowed_prefix(decoder, opened, EXTRA_KEY) == EXTRA_KEY


def test_strict_requires_every_property_and_non_strict_does_not(decoder):
    without_country = '{"city": "Paris", "population_millions": 2.1}'
    strict = request_grammar(json_schema(UNSAID))
    assert allowed_prefix(decoder, strict, without_country) != without_country  # "country" must come
    loose = request_grammar({"type": "json_schema", "json_schema": {"name": "c", "schema": UNSAID}})
    assert allowed_prefix(decoder, loose, without_country) == without_country


def test_numbers_have_llama_cpps_digit_bounds_in_schemas_objects_and_tool_calls(decoder):
    long_integer, long_fraction = "1" * 20, "0." + "3" * 20
    grammars = {
        "schema": request_grammar(json_schema(UNSAID | {"properties": {"n": {"type": "number"}}, "required": ["n"]})),
        "json_object": request_grammar({"type": "json_object"}),
        "tool": tools.grammar(tools.resolve(ChatCompletionRequest.model_validate(chat_body(
            ASK, tools=[{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"n": {"type": "number"}}}}}], tool_choice="required")))),
    }
    call = '{"tool_calls": [{"name": "f", "arguments": {"n": '
    prefixes = {"schema": '{"n": ', "json_object": '{"n": ', "tool": call}
    for name, grammar in grammars.items():
        prefix = prefixes[name]
        assert allowed_prefix(decoder, grammar, prefix + long_integer) == prefix + "1" * 16, name
        assert allowed_prefix(decoder, grammar, prefix + long_fraction) == prefix + "0." + "3" * 16, name
        assert allowed_prefix(decoder, grammar, prefix + "-12.5e7}") == prefix + "-12.5e7}", name
    in_string = '{"s": "' + "7" * 40 + '"}'  # digits in a string are not a number
    assert allowed_prefix(decoder, grammars["json_object"], in_string) == in_string


async def test_the_digit_bounds_are_configurable(decoder):
    schema = {"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"],
              "additionalProperties": False}
    async with running_app(make_config(json_integer_digits=2), decoder) as (_, client):
        response = await client.post("/v1/chat/completions", json=chat_body(
            "How many people live in Tokyo? Answer as JSON.", temperature=0, max_tokens=32,
            response_format=json_schema(schema)))
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert 0 <= abs(json.loads(choice["message"]["content"])["population"]) < 100


async def test_a_strict_schema_without_additional_properties_finishes_with_every_key(client):
    answer = await chat(client, max_tokens=96, response_format=json_schema(UNSAID))
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert set(json.loads(choice["message"]["content"])) == {"city", "country", "population_millions"}
