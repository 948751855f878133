"""Tool calls: the plan's checks, the generic prompt, the call grammar, the incremental parser and its stream
deltas (no model); then over HTTP on the real default model (``real_model``): forced calls match the schema,
``auto`` keeps plain answers as text, a stream reassembles into the whole reply, a two-turn loop."""

from __future__ import annotations

import json
import random

import jsonschema_rs
import pytest

from server import tool_calls, tools
from server.completion_objects import DeltaToolCall
from server.errors import BadRequestError
from server.messages import chat_message
from server.protocol import ChatCompletionRequest
from server.text import TextCodec
from tests.server.conftest import make_config
from tests.server.helpers import chat_body, running_app, sse_events

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False,
    },
}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: any arguments object
CLOCK = {"type": "function", "function": {"name": "now", "description": "The current time",
                                          "parameters": {"type": "object", "properties": {},
                                                         "additionalProperties": False}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def plan_of(**fields) -> tools.ToolPlan:
    plan = tools.resolve(request(**fields))
    assert plan is not None
    return plan


# --- the plan ---------------------------------------------------------------------------------------------------


def test_tool_choice_defaults_to_auto_with_tools_and_none_leaves_them_out():
    assert plan_of(tools=[WEATHER]).mode == "auto" and plan_of(tools=[WEATHER]).parallel
    assert tools.resolve(request()) is None and tools.resolve(request(tools=[])) is None
    assert tools.resolve(request(tools=[WEATHER], tool_choice="none")) is None
    named = plan_of(tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}},
                    parallel_tool_calls=False)
    assert (named.mode, [f.name for f in named.callable], named.parallel) == ("named", ["now"], False)


@pytest.mark.parametrize("fields, messages, param", [
    ({"tool_choice": "required"}, USER, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, USER, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, USER, "tools[1].function.name"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, USER, "response_format"),
    ({}, [{"role": "user", "content": "x", "tool_calls": []}, {"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], "messages[1].tool_calls"),
])
def test_bad_tool_fields_are_400s_naming_the_field(fields, messages, param):
    """(A tool message without ``tool_call_id`` never gets here: its type refuses it, ``tests/server/test_errors``.)"""
    body = ChatCompletionRequest.model_validate({"messages": messages, **fields})
    with pytest.raises(BadRequestError) as error:
        tools.resolve(body)
    assert error.value.param == param


# --- the prompt -------------------------------------------------------------------------------------------------


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
]


def test_generic_rendering_is_the_documented_text():
    body = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [WEATHER, NOW]})
    messages, tool_list = tools.render(body.messages, tools.resolve(body), native=False)
    assert tool_list is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"] == (
        "Be brief.\n\n"
        "You can call these tools (one JSON line per tool: its name, description and the JSON schema of its "
        "arguments):\n"
        + json.dumps({"name": "get_weather", "description": "Get the weather forecast for a city",
                      "parameters": WEATHER["function"]["parameters"]}) + "\n"
        '{"name": "now", "parameters": {"type": "object"}}\n'
        'To call a tool, reply with only this JSON: {"tool_calls": [{"name": "<tool name>", "arguments": '
        '{<arguments>}}, ...]}\nOtherwise reply in plain text.'
    )
    assert messages[2]["content"] == ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                      '{"name": "get_weather", "arguments": "not json"}]}')
    assert messages[3]["content"] == (
        '{"tool_result": {"name": "get_weather", "tool_call_id": "call_1", "content": "22 C"}}\n'
        '{"tool_result": {"name": "get_weather", "tool_call_id": "call_2", "content": "25 C"}}')
    again, _ = tools.render(body.messages, tools.resolve(body), native=False)
    assert again == messages  # deterministic


def test_required_and_named_sections_say_a_call_must_come():
    assert tools.tool_section(plan_of(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)).endswith(
        'Call a tool now: reply with only this JSON: {"tool_call": {"name": "<tool name>", "arguments": '
        '{<arguments>}}}')
    named = plan_of(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert "Call the tool get_weather now" in tools.tool_section(named)


def test_without_tools_history_still_renders_and_no_section_is_added():
    body = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"})
    messages, _ = tools.render(body.messages, tools.resolve(body), native=False)
    assert messages[0] == {"role": "system", "content": "Be brief."} and messages[3]["role"] == "user"


@pytest.mark.real_model  # the real tokenizer
def test_a_template_that_reads_tools_gets_them_natively(tokenizer):
    template = ("{% for t in tools %}T:{{ t.function.name }}\n{% endfor %}{% for m in messages %}{{ m.role }}:"
                "{{ m.content }}{% for c in m.tool_calls or [] %}CALL:{{ c.function.name }}{{ c.function.arguments "
                "| tojson }}{% endfor %}{% if m.tool_call_id %}ID:{{ m.tool_call_id }}{% endif %}\n{% endfor %}")
    codec = TextCodec(tokenizer, template)
    assert codec.native_tools and not TextCodec(tokenizer).native_tools
    body = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [WEATHER]})
    messages, tool_list = tools.render(body.messages, tools.resolve(body), native=True)
    text = tokenizer.decode(codec.encode_chat(messages, tools=tool_list))
    assert text.startswith("T:get_weather\nsystem:Be brief.user:")
    assert 'CALL:get_weather{"city": "Paris"}' in text and "tool:22 CID:call_1" in text


# --- the grammar ------------------------------------------------------------------------------------------------


def test_call_schema_accepts_calls_of_the_tools_only():
    single = jsonschema_rs.validator_for(tools.call_schema(plan_of(tools=[WEATHER, NOW], parallel_tool_calls=False)))
    good = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}
    assert single.is_valid({"tool_call": good}) and single.is_valid({"tool_call": {"name": "now", "arguments": {}}})
    assert not single.is_valid({"tool_call": {**good, "name": "other"}})
    assert not single.is_valid({"tool_call": {**good, "arguments": {"city": "Paris", "unit": "kelvin", "days": 3}}})
    assert not single.is_valid({"tool_calls": [good]})
    parallel = jsonschema_rs.validator_for(tools.call_schema(plan_of(tools=[WEATHER, NOW])))
    assert parallel.is_valid({"tool_calls": [good, {"name": "now", "arguments": {"x": 1}}]})
    assert not parallel.is_valid({"tool_calls": []})
    assert not parallel.is_valid({"tool_calls": [good] * (tools.MAX_PARALLEL_CALLS + 1)})
    named = jsonschema_rs.validator_for(tools.call_schema(
        plan_of(tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}})))
    assert named.is_valid({"tool_calls": [{"name": "now", "arguments": {}}]})
    assert not named.is_valid({"tool_calls": [good]})


def test_definitions_move_to_the_root_with_their_references():
    point = {"type": "object", "$defs": {"P": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/P"}}}
    body = {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": point}}]}
    schema = tools.call_schema(tools.resolve(ChatCompletionRequest.model_validate(body)))
    assert schema["$defs"] == {"f.P": {"type": "integer"}}
    validator = jsonschema_rs.validator_for(schema)
    assert validator.is_valid({"tool_calls": [{"name": "f", "arguments": {"x": 1}}]})
    assert not validator.is_valid({"tool_calls": [{"name": "f", "arguments": {"x": "1"}}]})


def test_forced_choices_get_the_schema_and_auto_gets_text_or_a_call():
    assert tools.grammar(plan_of(tools=[WEATHER], tool_choice="required")).kind == "json_schema"
    auto = tools.grammar(plan_of(tools=[WEATHER]))
    assert auto.kind == "lark" and "TEXT: /[^{]" in auto.source and '"const": "get_weather"' in auto.source
    assert [param for param, _ in tools.parameter_grammars(plan_of(tools=[NOW, WEATHER]))] == [
        "tools[1].function.parameters"]


# --- the output -------------------------------------------------------------------------------------------------


CALLS = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "days": 3, '
         '"n": [1, 2.5e3, true, null], "o": {"k": "v"}}}, {"name": "now", "arguments": {}}]}')


def events(text: str, calls_only: bool = True, cuts: list[int] | None = None) -> list[tool_calls.ToolEvent]:
    parser, bounds = tool_calls.ToolCallParser(calls_only), [0, *(cuts or []), len(text)]
    found = [event for start, end in zip(bounds, bounds[1:], strict=False) for event in parser.feed(text[start:end])]
    return tool_calls._merged([*found, *parser.finish()])


@pytest.mark.parametrize("text, calls_only, expected", [
    (CALLS, True, [("call", "get_weather", 0),
                   ("arguments", '{"city":"Paris, \\"FR\\"","days":3,"n":[1,2.5e3,true,null],"o":{"k":"v"}}', 0),
                   ("call", "now", 1), ("arguments", "{}", 1)]),
    ('{"tool_call": {"name": "now", "arguments": {"a": 1}}}', False, [("call", "now", 0),
                                                                     ("arguments", '{"a":1}', 0)]),
    ('{"tool_call": {"arguments": {"a": 1}, "name": "now"}}', True, [("call", "now", 0),
                                                                    ("arguments", '{"a":1}', 0)]),
    ('{"tool_call": {"name": "now", "arguments": {"a": 12', True, [("call", "now", 0), ("arguments", '{"a":12', 0)]),
    ('{"tool_calls": [{"name": "no', True, []),
    ("Paris {is} the capital.", False, [("content", "Paris {is} the capital.", 0)]),
    (" {not a call}", False, [("content", " {not a call}", 0)]),
])
def test_parser_events(text, calls_only, expected):
    assert [(e.kind, e.text, e.index) for e in events(text, calls_only)] == expected


def test_events_do_not_depend_on_how_the_text_is_cut():
    rng = random.Random(0)
    whole = events(CALLS)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(CALLS)), rng.randint(1, 30)))
        assert events(CALLS, cuts=cuts) == whole


def test_arguments_stream_while_generated():
    parser = tool_calls.ToolCallParser(calls_only=True)
    assert parser.feed('{"tool_call": {"name": "get_weather", "arguments": {"ci') == [
        tool_calls.ToolEvent("call", "get_weather"), tool_calls.ToolEvent("arguments", '{"ci')]
    assert parser.feed('ty": "Par') == [tool_calls.ToolEvent("arguments", 'ty":"Par')]


def reassemble(deltas: list[DeltaToolCall]) -> list[dict]:
    """OpenAI's client-side rule: the first delta of an index opens the call, later ones append arguments."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        if delta.id is not None:
            assert delta.type == "function" and delta.function.arguments == "" and delta.index not in calls
            calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
        else:
            assert delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments
    return [calls[index] for index in sorted(calls)]


def test_stream_deltas_reassemble_into_the_whole_reply():
    plan = plan_of(tools=[WEATHER, NOW], tool_choice="required")
    stream, pieces = tool_calls.ToolStream(plan), []
    for start in range(0, len(CALLS), 7):
        pieces += stream.feed(CALLS[start:start + 7])
    pieces += stream.close()
    assert all(isinstance(piece, DeltaToolCall) for piece in pieces)
    streamed = reassemble(pieces)
    content, calls = tool_calls.reply(plan, CALLS)
    assert content is None and [(c["name"], c["arguments"]) for c in streamed] == [
        (call.function.name, call.function.arguments) for call in calls]
    ids = [call.id for call in calls] + [c["id"] for c in streamed]
    assert len(set(ids)) == 4 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert json.loads(calls[0].function.arguments)["city"] == 'Paris, "FR"'
    assert tool_calls.reply(plan_of(tools=[WEATHER]), "Sunny.") == ("Sunny.", None)
    assert tool_calls.finish_reason("stop", 2) == "tool_calls" and tool_calls.finish_reason("length", 2) == "length"


# --- over HTTP, on the real default model ------------------------------------------------------------------------


@pytest.fixture
async def client(decoder):
    async with running_app(make_config(), decoder) as (_, client):
        yield client


async def post(client, content: str, **fields) -> dict:
    response = await client.post("/v1/chat/completions", json=chat_body(content, temperature=0, **fields))
    assert response.status_code == 200, response.text
    return response.json()


def streamed(response_text: str) -> tuple[str, list[dict], list[dict], str]:
    """Content, reassembled calls, logprobs and finish reason of an SSE body."""
    chunks = [json.loads(event) for event in sse_events(response_text) if event != "[DONE]"]
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    content = "".join(choice["delta"].get("content") or "" for choice in choices)
    deltas = [DeltaToolCall.model_validate(call)
              for choice in choices for call in choice["delta"].get("tool_calls", [])]
    logprobs = [entry for choice in choices for entry in (choice.get("logprobs") or {}).get("content") or []]
    return content, reassemble(deltas), logprobs, choices[-1]["finish_reason"]


@pytest.mark.real_model
async def test_required_call_matches_the_schema_and_streams_the_same(client):
    fields = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 64,
              "logprobs": True}
    whole = await post(client, "What will the weather be in Paris for the next 3 days?", **fields)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert arguments["unit"] in ("celsius", "fahrenheit") and isinstance(arguments["days"], int)
    assert 1 <= arguments["days"] <= 7 and set(arguments) == {"city", "unit", "days"}
    assert len(choice["logprobs"]["content"]) == whole["usage"]["completion_tokens"]

    body = chat_body("What will the weather be in Paris for the next 3 days?", temperature=0, stream=True, **fields)
    response = await client.post("/v1/chat/completions", json=body)
    content, calls, logprobs, reason = streamed(response.text)
    assert content == "" and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call["function"]["arguments"])]
    assert [entry["token"] for entry in logprobs] == [entry["token"] for entry in choice["logprobs"]["content"]]
    assert [entry["logprob"] for entry in logprobs] == pytest.approx(
        [entry["logprob"] for entry in choice["logprobs"]["content"]], abs=1e-4)  # step shapes may differ


@pytest.mark.real_model
async def test_named_and_parallel_calls(client):
    named = await post(client, "What time is it?", tools=[WEATHER, CLOCK], max_tokens=32, parallel_tool_calls=False,
                       tool_choice={"type": "function", "function": {"name": "now"}})
    [call] = named["choices"][0]["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("now", "{}")

    parallel = await post(client, "Weather in Paris for 2 days, and the time?", tools=[WEATHER, CLOCK],
                          tool_choice="required", max_tokens=48)
    choice = parallel["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert 1 <= len(calls) <= tools.MAX_PARALLEL_CALLS and len({c["id"] for c in calls}) == len(calls)
    assert {c["function"]["name"] for c in calls} <= {"get_weather", "now"}
    parsed = [parsed_object(c["function"]["arguments"]) for c in calls]
    assert parsed[0] is not None and all(arguments is not None for arguments in parsed[:-1])
    assert parsed[-1] is not None or choice["finish_reason"] == "length"  # the last may be cut by max_tokens


def parsed_object(text: str) -> dict | None:
    """``text`` as a JSON object; None when it is not one (arguments cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@pytest.mark.real_model
async def test_auto_answers_a_plain_question_in_text_streamed_as_content(client):
    fields = {"tools": [WEATHER], "max_tokens": 12}
    whole = (await post(client, "What is the capital of France?", **fields))["choices"][0]
    assert "tool_calls" not in whole["message"] and "Paris" in whole["message"]["content"]
    response = await client.post("/v1/chat/completions", json=chat_body(
        "What is the capital of France?", temperature=0, stream=True, **fields))
    content, calls, _, reason = streamed(response.text)
    assert (content, calls, reason) == (whole["message"]["content"], [], whole["finish_reason"])


@pytest.mark.real_model
async def test_a_tool_loop_call_result_then_text(client):
    question = [{"role": "user", "content": "What is the weather in Paris today?"}]
    first = await post(client, "", messages=question, tools=[WEATHER], tool_choice="required", max_tokens=64,
                       parallel_tool_calls=False)
    message = first["choices"][0]["message"]
    [call] = message["tool_calls"]
    history = [*question, message, {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 24 degrees"}]
    rendered = await client.post("/tokenize", json={"messages": history})
    prompt = (await client.post("/detokenize", json={"tokens": rendered.json()["tokens"]})).json()["prompt"]
    assert '{"tool_result": {"name": "get_weather", "tool_call_id": "' + call["id"] in prompt
    assert '{"tool_call": {"name": "get_weather", "arguments": ' not in prompt  # no plan: the tool_calls shape
    # tool_choice none: with auto the 135M model imitates the history and calls get_weather again
    final = (await post(client, "", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=24))
    assert final["choices"][0]["message"]["content"] and "tool_calls" not in final["choices"][0]["message"]


@pytest.mark.real_model
@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
async def test_http_errors_name_the_field(client, fields, param):
    response = await client.post("/v1/chat/completions", json={**chat_body("Hi", max_tokens=2), **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_messages_accept_tool_shapes():
    message = chat_message(**HISTORY[2])
    assert message.content is None and message.tool_calls and message.tool_calls[0].function.name == "get_weather"
