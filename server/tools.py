"""Tool calls: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` on any chat template.

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
- ``ToolCallParser`` reads the output as it streams and reports ``ToolEvent``s: content text, a call's start
  (its name, once complete) and fragments of its arguments' JSON text (whitespace outside strings dropped), so
  arguments stream as they are generated. ``ToolStream`` turns them into OpenAI's ``delta.tool_calls`` (ids
  ``call_`` + 24 random hex digits) and ``reply`` the whole text into ``message.content`` / ``tool_calls``;
  both go through the same parser, so a stream's deltas reassemble into the non-streamed calls exactly.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from decoding.params import JSON_WHITESPACE, LLAMA_CPP_NUMBERS, Grammar, NumberBounds
from server.errors import BadRequestError
from server.protocol import ChatCompletionRequest, ChatMessage, FunctionDefinition
from server.replies import DeltaFunctionCall, DeltaToolCall, ResponseFunctionCall, ResponseToolCall
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


@dataclass(frozen=True)
class ToolEvent:
    """What the output says: ``content`` text, a ``call`` start (``text`` its name) or ``arguments`` (``text`` a
    fragment of call ``index``'s arguments JSON)."""

    kind: Literal["content", "call", "arguments"]
    text: str
    index: int = 0


@dataclass
class _Frame:
    """An open JSON container: an object (``key`` its current member, ``expect`` what comes next) or an array
    (``key`` the index of its current element)."""

    kind: Literal["object", "array"]
    key: str | int | None = None
    expect: Literal["key", "colon", "value", "comma"] = "key"


@dataclass
class _Call:
    """One call being read: its name once complete, and argument fragments held until then."""

    index: int
    name: str | None = None
    held: list[str] = field(default_factory=list)


class ToolCallParser:
    """Reads the output piece by piece (module contract). ``calls_only`` (``required``, named): the output is a
    call object; else (``auto``) the first character decides: ``{`` starts one, anything else is content.

    Example, fed ``'{"tool_call": {"name": "f", "argum'`` then ``'ents": {"a": 1}}}'``: the first piece gives
    ``[ToolEvent("call", "f", 0)]``, the second ``[ToolEvent("arguments", '{"a":1}', 0)]`` (in one or more
    fragments, whitespace dropped). A call's events come once its name is complete.
    """

    def __init__(self, calls_only: bool) -> None:
        self.mode: Literal["undecided", "content", "calls"] = "calls" if calls_only else "undecided"
        self._stack: list[_Frame] = []
        self._string: list[str] | None = None  # the raw characters of the string being read, quotes included
        self._escape = False
        self._literal: list[str] | None = None  # a number, true, false or null being read
        self._capture: int | None = None  # stack depth at which the arguments value being read started
        self._call: _Call | None = None
        self.calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        """The events ``text`` completes."""
        if self.mode == "undecided" and text:
            self.mode = "calls" if text[0] == "{" else "content"
        if self.mode == "content":
            return [ToolEvent("content", text)] if text else []
        events: list[ToolEvent] = []
        for character in text:
            self._read(character, events)
        return _merged(events)

    def finish(self) -> list[ToolEvent]:
        """Events held at the end: a number that ends the output (``{"a": 1`` cut by max_tokens)."""
        events: list[ToolEvent] = []
        if self._literal is not None:
            self._end_literal(events)
        return _merged(events)

    def _read(self, character: str, events: list[ToolEvent]) -> None:
        if self._string is not None:
            self._string.append(character)
            self._emit(character, events)
            if self._escape:
                self._escape = False
            elif character == "\\":
                self._escape = True
            elif character == '"':
                self._end_string(events)
            return
        if self._literal is not None:
            if character not in ",}]" + JSON_SPACE:
                self._literal.append(character)
                self._emit(character, events)
                return
            self._end_literal(events)
        if character in JSON_SPACE:
            return
        top = self._stack[-1] if self._stack else None
        if character == '"':
            if top is not None and top.kind == "object" and top.expect == "key":
                self._emit(character, events)
            else:
                self._start_value(character, events)
            self._string = [character]
        elif character in "{[":
            self._start_value(character, events)
            self._stack.append(_Frame("object" if character == "{" else "array", key=0 if character == "[" else None,
                                      expect="key" if character == "{" else "value"))
        elif character in "}]":
            self._emit(character, events)
            if self._stack:
                self._stack.pop()
            self._end_value(events)
        elif character == ":" and top is not None:
            self._emit(character, events)
            top.expect = "value"
        elif character == "," and top is not None:
            self._emit(character, events)
            if top.kind == "array" and isinstance(top.key, int):
                top.key += 1
                top.expect = "value"
            else:
                top.expect = "key"
        else:
            self._start_value(character, events)
            self._literal = [character]

    def _path(self) -> tuple[str | int | None, ...]:
        return tuple(frame.key for frame in self._stack)

    def _call_index(self, path: tuple[str | int | None, ...]) -> int | None:
        """The index of the call whose object sits at ``path``, if one does."""
        if path == ("tool_call",):
            return 0
        if len(path) == 2 and path[0] == "tool_calls" and isinstance(path[1], int):
            return path[1]
        return None

    def _start_value(self, character: str, events: list[ToolEvent]) -> None:
        path = self._path()
        if self._capture is None and self._call is not None and path[-1:] == ("arguments",) \
                and self._call_index(path[:-1]) == self._call.index:
            self._capture = len(self._stack)
        self._emit(character, events)
        index = self._call_index(path)
        if index is not None and character == "{":
            self._call = _Call(index)

    def _end_value(self, events: list[ToolEvent]) -> None:
        """A value just ended (the stack already popped for a container)."""
        if self._capture is not None and len(self._stack) <= self._capture:
            self._capture = None
        if self._stack:
            self._stack[-1].expect = "comma"

    def _end_string(self, events: list[ToolEvent]) -> None:
        raw, self._string = "".join(self._string or []), None
        top = self._stack[-1] if self._stack else None
        if top is not None and top.kind == "object" and top.expect == "key":
            top.key, top.expect = json.loads(raw), "colon"
            return
        path = self._path()
        if self._call is not None and path[-1:] == ("name",) and self._call_index(path[:-1]) == self._call.index \
                and self._call.name is None:
            self._call.name = json.loads(raw)
            self.calls += 1
            events.append(ToolEvent("call", self._call.name, self._call.index))
            events.extend(ToolEvent("arguments", text, self._call.index) for text in self._call.held)
            self._call.held.clear()
        self._end_value(events)

    def _end_literal(self, events: list[ToolEvent]) -> None:
        self._literal = None
        self._end_value(events)

    def _emit(self, character: str, events: list[ToolEvent]) -> None:
        """``character`` belongs to the arguments being read: out now, or held until the call's name is known."""
        if self._capture is None or self._call is None:
            return
        if self._call.name is None:
            self._call.held.append(character)
        else:
            events.append(ToolEvent("arguments", character, self._call.index))


def _merged(events: Iterable[ToolEvent]) -> list[ToolEvent]:
    """Consecutive fragments of one call's arguments (or of content) joined into one event."""
    merged: list[ToolEvent] = []
    for event in events:
        if merged and event.kind != "call" and merged[-1].kind == event.kind and merged[-1].index == event.index:
            merged[-1] = ToolEvent(event.kind, merged[-1].text + event.text, event.index)
        else:
            merged.append(event)
    return merged


def new_call_id() -> str:
    """``call_`` and 24 random hex digits."""
    return f"call_{secrets.token_hex(12)}"


class ToolStream:
    """OpenAI's pieces of a reply under a ``ToolPlan``: ``feed(text)`` gives the content and ``delta.tool_calls``
    of each new piece, ``close()`` what the end releases; ``calls`` counts the calls started so far."""

    def __init__(self, plan: ToolPlan) -> None:
        self._parser = ToolCallParser(calls_only=plan.mode != "auto")
        self._ids: dict[int, str] = {}

    @property
    def calls(self) -> int:
        return self._parser.calls

    def feed(self, text: str) -> list[str | DeltaToolCall]:
        """Content text and tool call deltas, in order."""
        return [self._delta(event) for event in self._parser.feed(text)]

    def close(self) -> list[str | DeltaToolCall]:
        return [self._delta(event) for event in self._parser.finish()]

    def _delta(self, event: ToolEvent) -> str | DeltaToolCall:
        if event.kind == "content":
            return event.text
        if event.kind == "call":
            self._ids[event.index] = call_id = new_call_id()
            return DeltaToolCall(index=event.index, id=call_id, type="function",
                                 function=DeltaFunctionCall(name=event.text, arguments=""))
        return DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text))


def reply(plan: ToolPlan, text: str) -> tuple[str | None, list[ResponseToolCall] | None]:
    """The whole reply as ``message.content`` and ``message.tool_calls``: content is null when there are calls
    and no text, ``tool_calls`` None when there are none."""
    stream = ToolStream(plan)
    pieces = [*stream.feed(text), *stream.close()]
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    calls: dict[int, ResponseToolCall] = {}
    for piece in pieces:
        if isinstance(piece, str):
            continue
        if piece.id is not None:
            calls[piece.index] = ResponseToolCall(
                id=piece.id, function=ResponseFunctionCall(name=piece.function.name or "", arguments=""))
        else:
            calls[piece.index].function.arguments += piece.function.arguments
    if not calls:
        return content, None
    return content or None, [calls[index] for index in sorted(calls)]


def finish_reason(reason: str, calls: int) -> str:
    """``tool_calls`` when a reply with calls ended normally; ``length`` (a call may be cut short) otherwise."""
    return "tool_calls" if calls and reason == "stop" else reason
