"""Tool calls, the request side: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` on any chat
template: what the prompt shows and what the output must match.

Contract:
- ``resolve(request)`` checks the tool fields (400 naming the field) and returns a ``ToolPlan``, or None when no
  call can come (no tools, or ``tool_choice: "none"``; then the tools are left out of the prompt, as vLLM's
  ``--exclude-tools-when-tool-choice-none`` does, and the output is plain text).
- ``render(request, plan, native)`` turns the messages into what the chat template gets. A template that reads
  ``tools`` (``native``) gets the tools, the assistant ``tool_calls`` and the ``tool`` messages as Hugging Face
  documents them. Any other template gets the generic format (llama.cpp's fallback for templates without tool
  support): a system section listing each tool as one JSON line and the JSON shape of a call, assistant calls
  in the history as that same JSON, tool results as a user turn of ``{"tool_result": ...}`` lines.
- ``grammar(plan)`` is what the output must match. The call shape is ``{"tool_call": {"name", "arguments"}}``
  with ``parallel_tool_calls`` false, else ``{"tool_calls": [...]}`` of 1 to ``MAX_PARALLEL_CALLS`` calls;
  each call's ``name`` is a const and its ``arguments`` the function's ``parameters`` schema (any object when
  absent), its objects closed by ``server.schemas`` (OpenAI's strict rules with ``strict``). ``required`` and a
  named ``tool_choice`` (only that function) must produce it; ``auto`` may produce it or plain text: the first
  character decides (``{`` starts a call, which is then enforced; anything else is
  text, left free). See docs/design.md, "Tool calls".

The reply side (reading the calls back out of the output): ``server.tool_calls``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from decoding.params import JSON_WHITESPACE, LLAMA_CPP_NUMBERS, Grammar, NumberBounds
from server.errors import BadRequestError
from server.messages import ChatMessage
from server.protocol import ChatCompletionRequest, FunctionDefinition
from server.schemas import closed_schema

MAX_PARALLEL_CALLS = 8  # a tiny model asked for "one or more" calls may otherwise repeat calls until max_tokens
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# auto: text that does not start with "{", or a call (enforced); empty output allowed.
AUTO_GRAMMAR = "start: (TEXT | call)?\nTEXT: /[^{](.|\\n)*/\ncall: %json {schema}\n"
JSON_SPACE = " \t\n\r"
ToolMode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What a request allows: ``tools`` listed in the prompt, ``callable`` the functions a call may name (all
    tools, or the named one), ``mode`` (``auto``, ``required`` or ``named``) and ``parallel`` (an array of calls
    rather than exactly one)."""

    tools: tuple[FunctionDefinition, ...]
    callable: tuple[FunctionDefinition, ...]
    mode: ToolMode
    parallel: bool

    @property
    def key(self) -> str:
        """The top-level key of a call object: ``tool_calls`` (parallel) or ``tool_call``."""
        return "tool_calls" if self.parallel else "tool_call"


def resolve(request: ChatCompletionRequest) -> ToolPlan | None:
    """The request's ``ToolPlan``, or None when no call can come (``none``, or ``auto`` without tools); 400 for a
    ``required`` or named choice without tools (``tool_choice``), a name no tool has (``tool_choice``), two tools
    with one name (``tools[i].function.name``), ``response_format`` with calls possible, and bad tool messages
    (``check_messages``)."""
    check_messages(request.messages)
    functions = tuple(tool.function for tool in request.tools or [])
    seen: set[str] = set()
    for index, function in enumerate(functions):
        if function.name in seen:
            raise BadRequestError(f"two tools are named {function.name!r}", param=f"tools[{index}].function.name")
        seen.add(function.name)
    choice = request.tool_choice if request.tool_choice is not None else "auto"
    if choice == "none" or (choice == "auto" and not functions):
        return None
    if not functions:
        raise BadRequestError(f"tool_choice {_choice_text(choice)} needs tools", param="tool_choice")
    if request.response_format is not None and request.response_format.type != "text":
        raise BadRequestError("response_format cannot be combined with tool calls yet; send tool_choice: none or "
                              "leave response_format out", param="response_format")
    if isinstance(choice, str):
        return ToolPlan(functions, functions, choice, request.parallel_tool_calls)
    named = [function for function in functions if function.name == choice.function.name]
    if not named:
        raise BadRequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                              param="tool_choice")
    return ToolPlan(functions, tuple(named), "named", request.parallel_tool_calls)


def _choice_text(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming {choice.function.name!r}"


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """400 for ``tool_calls`` outside assistant messages (a ``tool`` message's ``tool_call_id`` is its type's)."""
    for index, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise BadRequestError("only assistant messages carry tool_calls", param=f"messages[{index}].tool_calls")


# --- the prompt -------------------------------------------------------------------------------------------------


def render(
    messages: Sequence[ChatMessage], plan: ToolPlan | None, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The template's messages and ``tools`` (None: not passed) for ``messages`` under ``plan`` (module
    contract); without tool messages, calls or a plan the messages are plain ``{"role", "content"}``."""
    if native:
        return [_native_message(message) for message in messages], _native_tools(plan)
    rendered = _generic_history(messages, plan)
    if plan is not None:
        rendered = _with_system_section(rendered, tool_section(plan))
    return rendered, None


def _native_tools(plan: ToolPlan | None) -> list[dict[str, Any]] | None:
    if plan is None:
        return None
    return [{"type": "function", "function": function.model_dump(exclude_none=True)} for function in plan.tools]


def _native_message(message: ChatMessage) -> dict[str, Any]:
    """Hugging Face's message shape: ``tool_calls`` with arguments as objects, ``tool_call_id`` and ``name``."""
    rendered: dict[str, Any] = {"role": message.role}
    if message.content is not None or message.role != "assistant" or not message.tool_calls:
        rendered["content"] = message.text()
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": _arguments_value(call.function.arguments)}}
            for call in message.tool_calls
        ]
    for name in ("tool_call_id", "name"):
        if getattr(message, name):
            rendered[name] = getattr(message, name)
    return rendered


def _arguments_value(arguments: str) -> Any:
    """A call's arguments as a JSON value when they parse, else the string as sent."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def tool_section(plan: ToolPlan) -> str:
    """The generic format's system prompt section: the tools, one JSON line each, then how to call them.

    >>> plan = ToolPlan((FunctionDefinition(name="now"),) * 1, (FunctionDefinition(name="now"),), "auto", False)
    >>> print(tool_section(plan))
    You can call these tools (one JSON line per tool: its name, description and the JSON schema of its arguments):
    {"name": "now", "parameters": {"type": "object"}}
    To call a tool, reply with only this JSON: {"tool_call": {"name": "<tool name>", "arguments": {<arguments>}}}
    Otherwise reply in plain text.
    """
    lines = ["You can call these tools (one JSON line per tool: its name, description and the JSON schema of its "
             "arguments):"]
    for function in plan.tools:
        entry: dict[str, Any] = {"name": function.name}
        if function.description:
            entry["description"] = function.description
        entry["parameters"] = function.parameters if function.parameters is not None else ANY_OBJECT
        lines.append(json.dumps(entry, ensure_ascii=False))
    call = '{"name": "<tool name>", "arguments": {<arguments>}}'
    shape = f'{{"tool_calls": [{call}, ...]}}' if plan.parallel else f'{{"tool_call": {call}}}'
    if plan.mode == "auto":
        lines += [f"To call a tool, reply with only this JSON: {shape}", "Otherwise reply in plain text."]
    elif plan.mode == "required":
        lines.append(f"Call a tool now: reply with only this JSON: {shape}")
    else:
        lines.append(f"Call the tool {plan.callable[0].name} now: reply with only this JSON: {shape}")
    return "\n".join(lines)


def _with_system_section(messages: list[dict[str, Any]], section: str) -> list[dict[str, Any]]:
    """``section`` appended to the first message when it is a system (or developer) one, else a new first one."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        text = f"{first['content']}\n\n{section}" if first["content"] else section
        return [{**first, "content": text}, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def _generic_history(messages: Sequence[ChatMessage], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """Plain ``{"role", "content"}`` messages: calls as JSON after the assistant's text, runs of tool messages
    as one user message of ``{"tool_result": {"name", "tool_call_id", "content"}}`` lines."""
    names = {call.id: call.function.name for message in messages for call in message.tool_calls or []}
    rendered: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            result = {"name": names.get(message.tool_call_id or "", message.name), "tool_call_id":
                      message.tool_call_id, "content": message.text()}
            line = json.dumps({"tool_result": {k: v for k, v in result.items() if v is not None}}, ensure_ascii=False)
            if rendered and rendered[-1].get("tool_results"):
                rendered[-1]["content"] += "\n" + line
            else:
                rendered.append({"role": "user", "content": line, "tool_results": True})
            continue
        content = message.text()
        if message.tool_calls:
            call_json = calls_json([(call.function.name, call.function.arguments) for call in message.tool_calls],
                                   parallel=plan is None or plan.parallel)
            content = f"{content}\n{call_json}" if content else call_json
        rendered.append({"role": message.role, "content": content})
    return [{key: value for key, value in message.items() if key != "tool_results"} for message in rendered]


def calls_json(calls: Sequence[tuple[str, str]], parallel: bool) -> str:
    """(name, arguments text) pairs in the generic call shape (``tool_call`` for one call when not parallel).

    >>> calls_json([("now", "{}")], parallel=False)
    '{"tool_call": {"name": "now", "arguments": {}}}'
    """
    objects = [{"name": name, "arguments": _arguments_value(arguments)} for name, arguments in calls]
    if parallel or len(objects) != 1:
        return json.dumps({"tool_calls": objects}, ensure_ascii=False)
    return json.dumps({"tool_call": objects[0]}, ensure_ascii=False)


# --- the grammar ------------------------------------------------------------------------------------------------


def call_schema(plan: ToolPlan) -> dict[str, Any]:
    """The JSON schema of a reply that calls tools (module contract); each function's ``$defs`` (or
    ``definitions``) move to the root under ``<name>.<definition>``, their references rewritten."""
    definitions: dict[str, Any] = {}
    calls = []
    for function in plan.callable:
        closed = closed_schema(function.parameters or ANY_OBJECT, bool(function.strict))
        parameters, moved = hoist_definitions(closed, function.name)
        definitions.update(moved)
        calls.append({
            "type": "object",
            "properties": {"name": {"const": function.name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    value = {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS} if plan.parallel else call
    schema: dict[str, Any] = {
        "type": "object", "properties": {plan.key: value}, "required": [plan.key], "additionalProperties": False,
    }
    if definitions:
        schema["$defs"] = definitions
    return schema


def hoist_definitions(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``schema`` without its ``$defs`` / ``definitions``, and those definitions renamed ``<prefix>.<name>``, every
    ``#/$defs/<name>`` (or ``#/definitions/<name>``) reference inside rewritten to match.

    >>> hoist_definitions({"$defs": {"A": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/A"}}}, "f")
    ({'properties': {'a': {'$ref': '#/$defs/f.A'}}}, {'f.A': {'type': 'integer'}})
    """
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not local:
        return schema, {}

    def rewrite(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: _renamed(item, prefix) if key == "$ref" else rewrite(item) for key, item in value.items()}
        if isinstance(value, list):
            return [rewrite(item) for item in value]
        return value

    body = {key: value for key, value in schema.items() if key not in ("$defs", "definitions")}
    return rewrite(body), {f"{prefix}.{name}": rewrite(value) for name, value in local.items()}


def _renamed(reference: Any, prefix: str) -> Any:
    for root in ("#/$defs/", "#/definitions/"):
        if isinstance(reference, str) and reference.startswith(root):
            return f"#/$defs/{prefix}.{reference[len(root):]}"
    return reference


def grammar(plan: ToolPlan, numbers: NumberBounds | None = LLAMA_CPP_NUMBERS) -> Grammar:
    """What the output must match: the call schema (``required``, named), or text or a call (``auto``); JSON
    numbers bounded by ``numbers``."""
    schema = call_schema(plan)
    if plan.mode != "auto":
        return Grammar.json_schema(schema, numbers)
    bounded = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}, **schema}  # as decoding.grammar does
    return Grammar("lark", AUTO_GRAMMAR.replace("{schema}", json.dumps(bounded)), numbers)


def parameter_grammars(plan: ToolPlan) -> list[tuple[str, Grammar]]:
    """(param name, grammar) of each tool's ``parameters`` schema, to check one by one (400 naming it)."""
    return [(f"tools[{index}].function.parameters", Grammar.json_schema(function.parameters))
            for index, function in enumerate(plan.tools) if function.parameters is not None]


# --- the output -------------------------------------------------------------------------------------------------
