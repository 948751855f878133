"""The Responses API: the translation to a chat request and the store (no model); then, with the official
``openai`` SDK over the in-process app on the real default model (``real_model``): text equal to chat's, streams
that reassemble to the whole response, a function call round trip (explicit history and
``previous_response_id``), structured output, ``max_output_tokens`` cuts, and errors in OpenAI's envelope."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from server.errors import APIError
from server.messages import chat_message
from server.protocol import NamedToolChoice
from server.response_store import ResponseStore
from server.responses import chat_request, input_messages, parse_request
from tests.server.conftest import make_config
from tests.server.helpers import Script, ScriptedDecoder, running_app, sse_events, token_steps

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Get the weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False},
}
QUESTION = "What is the weather in Paris today?"


# --- the translation and the store (no model) -------------------------------------------------------------------


def test_a_request_becomes_the_chat_request_it_decodes_as():
    request = parse_request({
        "model": MODEL, "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0, "seed": 3,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                                    "text": "in Paris?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                                  "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}',
             "id": "fc_1", "status": "completed"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Rain"}]},
        ],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "reasoning": {"effort": "low"}, "include": ["message.output_text.logprobs"], "truncation": "auto",
        "service_tier": "auto", "user": "u",  # ignored, as the Agents SDK sends some of them
    })
    earlier = [chat_message("user", content="Hello")]
    chat = chat_request(request, [*earlier, *input_messages(request.input)])
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Hello"), ("user", "Weather in Paris?"), ("assistant", "Checking."),
        ("tool", "Sunny"), ("tool", "Rain")]
    assistant = chat.messages[3]
    assert [(call.id, call.function.name, call.function.arguments) for call in assistant.tool_calls] == [
        ("c1", "get_weather", '{"city": "Paris"}'), ("c2", "get_weather", '{"city": "Lyon"}')]
    assert [m.tool_call_id for m in chat.messages[4:]] == ["c1", "c2"]
    assert (chat.max_tokens, chat.temperature, chat.seed, chat.n, chat.parallel_tool_calls) == (20, 0, 3, None, False)
    [tool] = chat.tools
    assert (tool.function.name, tool.function.parameters, tool.function.strict) == (
        "get_weather", WEATHER["parameters"], True)  # strict unset: true, as OpenAI's Responses API
    assert chat.tool_choice == NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})


@pytest.mark.parametrize("text, expected", [
    (None, None),
    ({"format": {"type": "text"}}, None),
    ({"format": {"type": "json_object"}}, {"type": "json_object", "json_schema": None}),
    ({"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True}},
     {"type": "json_schema", "json_schema": {"name": "city", "description": None, "schema": {"type": "object"},
                                             "strict": True}}),
])
def test_text_format_becomes_response_format(text, expected):
    request = parse_request({"input": "Hi", "text": text} if text else {"input": "Hi"})
    chat = chat_request(request, input_messages(request.input))
    found = chat.response_format
    assert (found.model_dump(by_alias=True) if found else None) == expected
    assert [(m.role, m.text()) for m in chat.messages] == [("user", "Hi")]


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "input_image", "image_url": "x"}]}, "input[1].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": "Hi", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": 2.5}, "temperature"),
    ({"input": "Hi", "store": "yes"}, "store"),
    ({}, "input"),
])
def test_bad_bodies_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as raised:
        parse_request(body)
    assert (raised.value.status, raised.value.param) == (400, param), raised.value.message


def test_an_input_without_messages_is_a_400_naming_input():
    request = parse_request({"input": []})
    with pytest.raises(APIError) as raised:
        chat_request(request, input_messages(request.input))
    assert (raised.value.status, raised.value.param) == (400, "input")


def test_the_store_evicts_the_least_recently_stored_and_0_stores_nothing():
    store = ResponseStore(2)
    for name in ("a", "b", "c"):
        store.put({"id": name}, [chat_message("user", content=name)])
    assert len(store) == 2 and store.get("c") == {"id": "c"} and store.conversation("b")[0].text() == "b"
    with pytest.raises(APIError) as raised:
        store.conversation("a")
    assert (raised.value.status, raised.value.param) == (404, "previous_response_id")
    empty = ResponseStore(0)
    empty.put({"id": "a"}, [])
    assert len(empty) == 0


# --- over HTTP, on the real default model -----------------------------------------------------------------------


@pytest.fixture
async def client(decoder):
    async with running_app(make_config(), decoder) as (_, client):
        yield client


def sdk(client: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """The official SDK over the in-process app."""
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


@pytest.mark.real_model
async def test_create_answers_in_text_as_chat_does(client):
    api = sdk(client)
    fields = {"model": MODEL, "temperature": 0}
    response = await api.responses.create(**fields, instructions="Answer in one sentence.",
                                          input="What is the capital of France?", max_output_tokens=32)
    chat = await api.chat.completions.create(**fields, max_tokens=32, messages=[
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert response.id.startswith("resp_") and response.object == "response" and response.error is None
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert [part.type for part in message.content] == ["output_text"] and message.content[0].annotations == []
    assert response.output_text == chat.choices[0].message.content and "Paris" in response.output_text
    assert response.status == "completed" and chat.choices[0].finish_reason == "stop"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert response.model_extra["decoding"]["method"] == "lookahead"
    assert (response.model, response.instructions, response.temperature, response.max_output_tokens) == (
        MODEL, "Answer in one sentence.", 0, 32)
    assert response.store is True and response.tools == [] and response.tool_choice == "auto"
    assert response.text.format.type == "text"
    assert (await api.responses.retrieve(response.id)).model_dump() == response.model_dump()


async def raw_events(api: openai.AsyncOpenAI, **fields) -> list:
    """Every event of ``create(stream=True)``."""
    return [event async for event in await api.responses.create(**fields, stream=True)]


@pytest.mark.real_model
async def test_a_stream_reassembles_into_the_whole_response(client):
    api = sdk(client)
    fields = {"model": MODEL, "input": "Write a haiku about the sea.", "temperature": 0, "max_output_tokens": 40}
    whole = await api.responses.create(**fields)
    async with api.responses.stream(**fields) as stream:
        helper = [event async for event in stream]
        final = await stream.get_final_response()
    deltas = [event.delta for event in helper if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status

    events = await raw_events(api, **fields)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    text_events = [kind for kind in kinds if kind != "response.output_text.delta"]
    assert text_events == ["response.created", "response.in_progress", "response.output_item.added",
                           "response.content_part.added", "response.output_text.done", "response.content_part.done",
                           "response.output_item.done", f"response.{whole.status}"]
    [done] = [event for event in events if event.type == "response.output_text.done"]
    assert done.text == whole.output_text and events[-1].response.output_text == whole.output_text
    created, last = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == last.id
    assert events[-1].response.output[0].id == events[2].item.id == done.item_id


@pytest.mark.real_model
async def test_a_function_call_round_trip(client):
    api = sdk(client)
    fields = {"model": MODEL, "temperature": 0, "tools": [WEATHER]}
    first = await api.responses.create(**fields, input=QUESTION, tool_choice="required", parallel_tool_calls=False,
                                       max_output_tokens=48)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and first.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}

    events = await raw_events(api, **fields, input=QUESTION, tool_choice="required", parallel_tool_calls=False,
                              max_output_tokens=48)
    arguments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == call.arguments
    [added] = [event.item for event in events if event.type == "response.output_item.added"]
    assert (added.type, added.name, added.arguments) == ("function_call", "get_weather", "")
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == call.arguments

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees"}
    history = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result]
    answer = await api.responses.create(**fields, input=history, tool_choice="none", max_output_tokens=24)
    assert answer.output[0].type == "message" and answer.output_text.strip()
    continued = await api.responses.create(**fields, input=[result], previous_response_id=first.id,
                                           tool_choice="none", max_output_tokens=24)
    assert continued.output_text == answer.output_text  # the stored conversation is the same history
    assert continued.previous_response_id == first.id


class City(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.mark.real_model
async def test_structured_output(client):
    api = sdk(client)
    parsed = await api.responses.parse(model=MODEL, input="Give the capital of France as JSON.", temperature=0,
                                       max_output_tokens=48, text_format=City)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.city and parsed.status == "completed"
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    response = await api.responses.create(model=MODEL, input="What is 2 + 2? Answer in JSON.", temperature=0,
                                          max_output_tokens=16, text={"format": {
                                              "type": "json_schema", "name": "sum", "schema": schema,
                                              "strict": True}})
    assert set(json.loads(response.output_text)) == {"answer"} and response.text.format.name == "sum"


@pytest.mark.real_model
async def test_a_stored_response_is_retrieved_as_it_was_sent(client):
    """``GET /v1/responses/{id}`` answers through its ``response_model`` and changes nothing: tools, ``text.format``
    (its ``schema`` an alias), metadata, the ``decoding`` extension."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    body = {"model": MODEL, "input": "What is 2 + 2? Answer in JSON.", "temperature": 0, "max_output_tokens": 12,
            "tools": [WEATHER], "tool_choice": "none", "metadata": {"k": "v"},
            "text": {"format": {"type": "json_schema", "name": "sum", "schema": schema}}}
    sent = await client.post("/v1/responses", json=body)
    stored = await client.get(f"/v1/responses/{sent.json()['id']}")
    assert sent.status_code == stored.status_code == 200, sent.text
    assert stored.json() == sent.json() and stored.json()["text"]["format"]["schema"] == schema


@pytest.mark.real_model
async def test_max_output_tokens_makes_it_incomplete(client):
    api = sdk(client)
    fields = {"model": MODEL, "input": "Write a long story about a dragon.", "temperature": 0, "max_output_tokens": 16}
    response = await api.responses.create(**fields)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 16 and response.output[0].status == "incomplete"
    events = await raw_events(api, **fields)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == response.output_text
    [item_done] = [event for event in events if event.type == "response.output_item.done"]
    assert item_done.item.status == "incomplete"


@pytest.mark.real_model
async def test_errors_are_openai_envelopes_and_the_server_keeps_serving(client):
    api = sdk(client)
    bad_item = [{"role": "user", "content": "Hi"}, {"type": "input_image", "image_url": "https://x/y.png"}]
    with pytest.raises(openai.BadRequestError) as raised:
        await api.responses.create(model=MODEL, input=bad_item)
    assert raised.value.body["param"] == "input[1].type"
    for fields, param in [({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
                          ({"tool_choice": "sometimes"}, "tool_choice"),
                          ({"tools": [{**WEATHER, "parameters": {"type": "nonsense"}}]}, "tools[0].parameters"),
                          ({"max_output_tokens": 100_000}, "max_output_tokens")]:
        body = {"model": MODEL, "input": "Hi", "tools": [WEATHER], **fields}
        response = await client.post("/v1/responses", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    with pytest.raises(openai.NotFoundError) as missing:
        await api.responses.create(model=MODEL, input="Hi", previous_response_id="resp_unknown")
    assert missing.value.body["param"] == "previous_response_id" and "resp_unknown" in missing.value.body["message"]
    unstored = await api.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.output_text and unstored.store is False
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(unstored.id)


@pytest.mark.real_model
async def test_a_failure_after_the_stream_started_is_an_error_event(tokenizer):
    script = Script(token_steps(tokenizer, [" one", " two", " three"]), fail_at=1)
    async with running_app(make_config(), ScriptedDecoder(tokenizer, lambda text: script)) as (app, client):
        response = await client.post("/v1/responses", json={"input": "Hi", "stream": True})
        events = [json.loads(event) for event in sse_events(response.text)]
        assert [event["type"] for event in events] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            "response.output_text.delta", "error"]
        assert events[4]["delta"] == " one" and "event: error" in response.text
        assert (events[-1]["code"], events[-1]["sequence_number"]) == ("internal_error", 5)
        whole = await client.post("/v1/responses", json={"input": "Hi"})
        assert whole.status_code == 500 and whole.json()["error"]["code"] == "internal_error"
        assert len(app.state.runtime.stored_responses) == 0  # nothing that failed is stored
