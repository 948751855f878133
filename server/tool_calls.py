"""Tool calls, the reply side: the calls read back out of the output, as it streams and whole.

Contract: ``ToolCallParser`` reads the output as it streams and reports ``ToolEvent``s: content text, a call's
start (its name, once complete) and fragments of its arguments' JSON text (whitespace outside strings dropped), so
arguments stream as they are generated. ``ToolStream`` turns them into OpenAI's ``delta.tool_calls`` (ids
``call_`` + 24 random hex digits) and ``reply`` the whole text into ``message.content`` / ``tool_calls``; both go
through the same parser, so a stream's deltas reassemble into the non-streamed calls exactly. ``finish_reason``
is ``tool_calls`` when a stop came after calls. The shapes parsed are those ``server.tools`` asks the output for.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from server.completion_objects import DeltaFunctionCall, DeltaToolCall, ResponseFunctionCall, ResponseToolCall
from server.tools import JSON_SPACE, ToolPlan


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
