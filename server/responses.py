"""OpenAI's Responses API, ``POST /v1/responses`` and ``GET /v1/responses/{id}``, over the chat path.

Contract: ``parse_request`` validates a body (400 naming the field, ``server.responses_protocol``); ``submit``
translates it into a ``ChatCompletionRequest`` (``chat_request``) and runs exactly chat's path (``server.chat``:
model check, tool checks, prompt, grammar, plans; ``server.serving``: admission) with a ``ResponsesRenderer``, so
whatever chat does (tool calls through ``server.tools``, structured output, lookahead, seeds) a response does
the same way. A 400 from that path names the Responses field (``responses_param``). The answer is OpenAI's
``response`` object (``ResponsesRenderer.response`` through ``serving.complete``), or with ``stream: true`` its
events (``events``: ``serving.stream``'s payloads as named SSE events with increasing ``sequence_number``):
``response.created``, ``response.in_progress``, per output item ``response.output_item.added`` (a message's
``response.content_part.added``, ``response.output_text.delta`` per piece, ``response.output_text.done``,
``response.content_part.done``; a call's ``response.function_call_arguments.delta`` and ``.done``),
``response.output_item.done``, then ``response.completed`` (or ``response.incomplete`` when max_output_tokens
cut it) with the whole response. An error after the stream started becomes one ``error`` event.

With ``store`` (the default) a finished response is kept in the ``ResponseStore`` (the last
``max_stored_responses``, in memory: a restart forgets) with its conversation (input messages and output turned
into chat messages, instructions left out as OpenAI does); ``previous_response_id`` puts that conversation before
the new input (404 naming it when unknown).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from decoding import InvalidParameterError, TokenLogprob
from server import chat, serving, tool_calls, tools
from server.body import parse_body
from server.completion_objects import DeltaToolCall, StepInfo
from server.errors import APIError, BadRequestError, to_api_error
from server.messages import ChatMessage, FunctionCall, ToolCall, chat_message
from server.plans import Output, Summary
from server.protocol import (
    ChatCompletionRequest,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
)
from server.rendering import decoding_of, usage_of
from server.response_store import ResponseStore
from server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseRequest,
    ResponseUsage,
    TextConfig,
    ToolChoice,
    field_names,
    joined,
)
from server.scheduler import Handle

if TYPE_CHECKING:
    from server.runtime import Runtime

FIELD_NAMES = field_names()
DONE = "[DONE]"  # serving.stream's last payload: chat's, not part of a Responses stream
CHAT_PARAMS = (  # chat's names of the fields a response translates (most specific first)
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)
TOOL_PARAM = re.compile(r"^tools\[(\d+)\]\.function\.")


def parse_request(body: Any) -> ResponseRequest:
    """Validate a ``/v1/responses`` body; 400 naming the first bad field (``input[2].type``)."""
    return parse_body(ResponseRequest, body, FIELD_NAMES)


def responses_param(param: str | None) -> str | None:
    """The Responses name of a field chat's path named (an input item for any part of the conversation).

    >>> responses_param("tools[1].function.parameters"), responses_param("messages[3].tool_call_id")
    ('tools[1].parameters', 'input')
    >>> responses_param("response_format.json_schema.schema"), responses_param("temperature")
    ('text.format.schema', 'temperature')
    """
    if param is None:
        return None
    for chat_name, responses_name in CHAT_PARAMS:
        if param == chat_name or param.startswith((f"{chat_name}.", f"{chat_name}[")):
            return responses_name
    return TOOL_PARAM.sub(r"tools[\1].", param)


def renamed(error: Exception) -> APIError:
    """``error`` as an API error whose ``param`` is the Responses field's name."""
    api_error = to_api_error(error)
    api_error.param = responses_param(api_error.param)
    return api_error


def input_messages(items: str | Sequence[InputItem]) -> list[ChatMessage]:
    """Input items as chat messages: a string is one user message; a message item keeps its role (content parts
    joined); a ``function_call`` joins the assistant message just before it, else starts one, as a
    ``tool_calls`` entry (``id`` = ``call_id``); a ``function_call_output`` is a ``tool`` message.

    >>> items = [FunctionCallItem(type="function_call", call_id="c1", name="f", arguments="{}"),
    ...          FunctionCallItem(type="function_call", call_id="c2", name="g", arguments="{}"),
    ...          FunctionCallOutputItem(type="function_call_output", call_id="c1", output="42")]
    >>> [(m.role, [c.id for c in m.tool_calls or []], m.tool_call_id) for m in input_messages(items)]
    [('assistant', ['c1', 'c2'], None), ('tool', [], 'c1')]
    """
    if isinstance(items, str):
        return [chat_message("user", content=items)]
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant":
                last = messages[-1]
                messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                messages.append(chat_message("assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(chat_message("tool", content=joined(item.output), tool_call_id=item.call_id))
        else:
            messages.append(chat_message(item.role, content=joined(item.content)))
    return messages


def strict_of(tool: FunctionTool) -> bool:
    """A function tool's ``strict``: true unless sent false (OpenAI's Responses default)."""
    return tool.strict is not False


def chat_tool_choice(choice: ToolChoice | None) -> Any:
    """``tool_choice`` in chat's shape: the same string, or ``{"type": "function", "function": {"name"}}``."""
    if isinstance(choice, FunctionChoice):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return choice


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    """``text.format`` as chat's ``response_format`` (None for plain text)."""
    if text is None or text.format.type == "text":
        return None
    found = text.format
    if found.type == "json_object":
        return ResponseFormat(type="json_object")
    schema = JsonSchemaFormat.model_validate({"name": found.name, "description": found.description,
                                              "schema": found.schema_, "strict": found.strict})
    return ResponseFormat(type="json_schema", json_schema=schema)


def chat_request(request: ResponseRequest, conversation: Sequence[ChatMessage]) -> ChatCompletionRequest:
    """The chat request a response decodes as: ``instructions`` as a first system message, then
    ``conversation`` (a stored previous response's, then ``input_messages(request.input)``); function tools as
    chat tools (``strict_of``), ``tool_choice`` and ``text.format`` in chat's shape, ``max_output_tokens`` as
    ``max_tokens``, the sampling fields and extensions as they are; always one choice. 400 naming ``input`` when
    there is no message at all."""
    messages = [chat_message("system", content=request.instructions)] if request.instructions else []
    messages += conversation
    if not messages:
        raise BadRequestError("input has no items: send at least one message", param="input")
    chat_tools = [Tool(type="function", function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=strict_of(tool)))
        for tool in request.tools or []]
    return ChatCompletionRequest(
        model=request.model, messages=messages, max_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p, seed=request.seed, lookahead=request.lookahead,
        cache_prompt=request.cache_prompt,
        tools=chat_tools or None, tool_choice=chat_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls, response_format=response_format(request.text),
    )


def new_id(prefix: str) -> str:
    """``<prefix>_`` and 32 random hex digits (``resp_``, ``msg_``, ``fc_``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def shell(request: ResponseRequest, model: str) -> ResponseObject:
    """The response before any output: a new ``resp_`` id, ``in_progress``, the request's settings echoed."""
    return ResponseObject(
        id=new_id("resp"), created_at=int(time.time()), status="in_progress", model=model,
        instructions=request.instructions, max_output_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p,
        tools=[tool.model_copy(update={"strict": strict_of(tool)}) for tool in request.tools or []],
        tool_choice=request.tool_choice or "auto", parallel_tool_calls=request.parallel_tool_calls,
        text=request.text or TextConfig(), previous_response_id=request.previous_response_id, store=request.store,
        metadata=request.metadata or {},
    )


async def submit(runtime: Runtime, request: ResponseRequest) -> tuple[list[Handle], ResponsesRenderer]:
    """Check, plan and admit one response on chat's path (module contract); its handle and renderer."""
    model = serving.check_model(runtime.config, request.model)
    store = runtime.stored_responses
    previous = store.conversation(request.previous_response_id) if request.previous_response_id else ()
    conversation = [*previous, *input_messages(request.input)]
    try:
        chat_body = chat_request(request, conversation)
        chat.check(runtime.config, chat_body)
        loaded = runtime.require_loaded()
        planned = await asyncio.to_thread(chat.plan, loaded, chat_body, "input")
        renderer = ResponsesRenderer(shell(request, model), planned.tools, conversation,
                                     store if request.store else None)
        return serving.start_many(loaded, planned.generations), renderer
    except (BadRequestError, InvalidParameterError) as error:
        raise renamed(error) from error


def output_messages(items: Sequence[OutputItem]) -> list[ChatMessage]:
    """A response's output as the assistant message a later turn sees: its text, its calls as ``tool_calls``."""
    text = "".join(part.text for item in items if isinstance(item, OutputMessage) for part in item.content)
    calls = [ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
             for item in items if isinstance(item, OutputFunctionCall)]
    return [chat_message("assistant", content=text if text or not calls else None, tool_calls=calls or None)]


class ResponsesRenderer:
    """``server.rendering.Renderer`` for one response (one choice): the whole ``response`` object, or its stream events
    (module contract), the reply read for tool calls under ``plan`` (``server.tools``) so that a stream's items
    equal the whole response's. The last item is ``incomplete`` when max_output_tokens cut the reply. A finished
    response goes to ``store`` (None: not stored) with ``conversation`` and its output as chat messages."""

    include_usage = True  # serving.stream then ends with ``usage``: the final event, which carries the usage

    def __init__(
        self, shell: ResponseObject, plan: tools.ToolPlan | None, conversation: Sequence[ChatMessage],
        store: ResponseStore | None,
    ) -> None:
        self.shell = shell
        self._plan = plan
        self._stream = tool_calls.ToolStream(plan) if plan is not None else None
        self._conversation = list(conversation)
        self._store = store
        self._sequence = 0
        self._items: list[OutputMessage | OutputFunctionCall] = []
        self._open = False  # the last item still takes deltas
        self._calls: dict[int, int] = {}  # a call's index in the reply -> its output index
        self._reason = "stop"

    # --- the whole response -----------------------------------------------------------------------------------

    def response(self, choices: Sequence[tuple[str, Output]]) -> dict[str, Any]:
        [(text, last)] = choices
        content, calls = tool_calls.reply(self._plan, text) if self._plan is not None else (text, None)
        self._reason = tool_calls.finish_reason(last.finish_reason or "stop", len(calls or []))
        items: list[OutputMessage | OutputFunctionCall] = []
        if content is not None:
            items.append(OutputMessage(id=new_id("msg"), status="completed", content=[OutputText(text=content)]))
        items += [OutputFunctionCall(id=new_id("fc"), call_id=call.id, name=call.function.name,
                                     arguments=call.function.arguments, status="completed") for call in calls or []]
        items[-1].status = self._last_status()
        self._items = items
        assert last.summary is not None
        return self._finished([last.summary])

    def _last_status(self) -> str:
        return "incomplete" if self._reason == "length" else "completed"

    def _finished(self, summaries: Sequence[Summary]) -> dict[str, Any]:
        """The final response (stored when asked), as JSON data."""
        usage = usage_of(summaries)
        incomplete = self._reason == "length"
        response = self.shell.model_copy(update={
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None,
            "output": self._items,
            "usage": ResponseUsage(
                input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens)),
            "decoding": decoding_of(summaries),
        })
        data = dump(response)
        if self._store is not None:
            self._store.put(data, [*self._conversation, *output_messages(self._items)])
        return data

    # --- the stream -------------------------------------------------------------------------------------------

    def start(self) -> list[str]:
        """The events before any output: ``response.created``, ``response.in_progress``."""
        shell = dump(self.shell)
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def opening(self, index: int) -> str | None:
        return None  # ``start`` sends the opening events

    def pending_echo(self, index: int) -> bool:
        return False

    def content(
        self, index: int, text: str, step: StepInfo | None = None,
        logprobs: Sequence[TokenLogprob] | None = None, prompt_logprobs: Sequence[TokenLogprob] | None = None,
    ) -> list[str]:
        return self._pieces(self._stream.feed(text) if self._stream is not None else [text])

    def finish(self, index: int, reason: str, step: StepInfo | None = None) -> list[str]:
        events = self._pieces(self._stream.close() if self._stream is not None else [])
        self._reason = tool_calls.finish_reason(reason, self._stream.calls if self._stream is not None else 0)
        if not self._items:
            events += self._open_message()  # an empty reply is an empty message, as in the whole response
        return events + self._close(self._last_status())

    def usage(self, summaries: Sequence[Summary]) -> str:
        data = self._finished(summaries)
        return self._event(f"response.{data['status']}", response=data)

    def error(self, body: dict[str, Any]) -> str:
        """The ``error`` event for an error envelope's ``error`` object."""
        return self._event("error", code=body.get("code"), message=body.get("message"), param=body.get("param"))

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"))

    def _pieces(self, pieces: Sequence[str | DeltaToolCall]) -> list[str]:
        """The events of content text and tool call deltas."""
        events: list[str] = []
        for piece in pieces:
            if isinstance(piece, str):
                events += self._text(piece)
            elif piece.id is not None:
                events += self._start_call(piece)
            else:
                events += self._arguments(piece)
        return events

    def _text(self, text: str) -> list[str]:
        events = [] if self._open and isinstance(self._items[-1], OutputMessage) else [*self._close("completed"),
                                                                                         *self._open_message()]
        item, index = self._items[-1], len(self._items) - 1
        assert isinstance(item, OutputMessage)
        item.content[0].text += text
        return events + [self._event("response.output_text.delta", item_id=item.id, output_index=index,
                                     content_index=0, delta=text, logprobs=[])]

    def _open_message(self) -> list[str]:
        item = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
        events = self._add(item)
        item.content.append(OutputText(text=""))
        return events + [self._event("response.content_part.added", item_id=item.id, output_index=len(self._items) - 1,
                                     content_index=0, part=dump(item.content[0]))]

    def _start_call(self, piece: DeltaToolCall) -> list[str]:
        events = self._close("completed")
        self._calls[piece.index] = len(self._items)
        item = OutputFunctionCall(id=new_id("fc"), call_id=piece.id or "", name=piece.function.name or "",
                                  arguments="", status="in_progress")
        return events + self._add(item)

    def _arguments(self, piece: DeltaToolCall) -> list[str]:
        index = self._calls[piece.index]
        item = self._items[index]
        assert isinstance(item, OutputFunctionCall)
        item.arguments += piece.function.arguments
        return [self._event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                            delta=piece.function.arguments)]

    def _add(self, item: OutputMessage | OutputFunctionCall) -> list[str]:
        self._items.append(item)
        self._open = True
        return [self._event("response.output_item.added", output_index=len(self._items) - 1, item=dump(item))]

    def _close(self, status: str) -> list[str]:
        """The events that finish the open item (none when none is open), which gets ``status``."""
        if not self._open:
            return []
        self._open = False
        item, index = self._items[-1], len(self._items) - 1
        item.status = status  # type: ignore[assignment]
        ids = {"item_id": item.id, "output_index": index}
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [self._event("response.output_text.done", **ids, content_index=0, text=part.text, logprobs=[]),
                      self._event("response.content_part.done", **ids, content_index=0, part=dump(part))]
        else:
            events = [self._event("response.function_call_arguments.done", **ids, arguments=item.arguments)]
        return events + [self._event("response.output_item.done", output_index=index, item=dump(item))]


def dump(model: Any) -> dict[str, Any]:
    """A response model as JSON data (``schema`` under its own name)."""
    return model.model_dump(mode="json", by_alias=True)


def sse(data: str) -> dict[str, str]:
    """One named SSE event for an event's JSON ``data``."""
    return {"event": json.loads(data)["type"], "data": data}


async def events(handles: Sequence[Handle], renderer: ResponsesRenderer) -> AsyncIterator[dict[str, str]]:
    """A streamed response's SSE events (module contract); cancels the request if the client goes away."""
    try:
        for data in renderer.start():
            yield sse(data)
        async with contextlib.aclosing(serving.stream(handles, renderer)) as payloads:
            async for data in payloads:
                if data == DONE:
                    continue
                event = json.loads(data)
                yield sse(data if "type" in event else renderer.error(event["error"]))
    finally:
        for handle in handles:
            handle.cancel()
