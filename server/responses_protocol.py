"""Pydantic mirror of OpenAI's Responses API (``POST /v1/responses``) as this server supports it.

Contract: ``ResponseRequest`` is strict like the chat request models (``server.protocol``) and ignores unknown
fields (``reasoning``, ``include``, ``truncation``, ``user``, ``service_tier`` and whatever else a client sends).
Its sampling fields have chat's types (``server.protocol``'s ``Temperature``, ``Seed``, ...: each bound written
once). Its ``input`` is a string (one user message) or a list of items: messages (``role`` user, system, developer or
assistant; ``content`` a string or ``input_text`` / ``output_text`` parts), ``function_call`` and
``function_call_output`` items. Any other item type, content part or tool type is refused by name
(``input[2].type``, ``input[0].content[1].type``, ``tools[0].type``), never dropped. ``tools`` are function tools
(``strict`` unset means true, as in OpenAI's Responses API); ``text.format`` is ``text``, ``json_object`` or
``json_schema`` (with a ``name``). ``ResponseObject`` serializes to OpenAI's ``response`` object plus this
server's ``decoding`` extension (``server.completion_objects.DecodingInfo``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from server.completion_objects import DecodingInfo
from server.protocol import (
    FunctionName,
    LookaheadRequest,
    MaxTokens,
    ParallelToolCalls,
    Probability,
    Seed,
    ServedModel,
    Temperature,
    protocol_field_names,
    when,
)
from server.request_base import StrictModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]
TEXT_PART_TYPES = ("input_text", "output_text")
MEDIA_PART_TYPES = ("input_image", "input_file", "input_audio", "refusal")  # OpenAI's other content parts


class InputTextPart(StrictModel):
    """A content part: ``input_text`` (or ``output_text``, in an assistant message sent back); images, files,
    audio and refusals are refused by name."""

    type: Literal["input_text", "output_text"]
    text: str

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value in TEXT_PART_TYPES or not isinstance(value, str):
            return value
        if value in MEDIA_PART_TYPES:
            raise PydanticCustomError("unsupported_content", "{kind} content parts are not supported: the served "
                                      "model reads text only; send input_text parts", {"kind": value})
        raise PydanticCustomError("unknown_content", "unknown content part type '{kind}'; expected input_text or "
                                  "output_text", {"kind": value})


def joined(content: str | list[InputTextPart]) -> str:
    """Content as one string (parts joined without separator, as OpenAI does)."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(StrictModel):
    """A message; ``type`` may be left out. ``developer`` is treated as ``system``."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]


class FunctionCallItem(StrictModel):
    """A call the model made earlier (``call_id`` is what its output answers)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(StrictModel):
    """A function's result, answering the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]


class UnsupportedItem(StrictModel):
    """Any other item type (images, reasoning, file search, ...): always refused, naming ``input[i].type``."""

    type: str

    @field_validator("type")
    @classmethod
    def _refused(cls, value: str) -> str:
        raise PydanticCustomError("unsupported_item", "input items of type '{kind}' are not supported; send "
                                  "message, function_call or function_call_output items", {"kind": value})


SUPPORTED_ITEMS = ("message", "function_call", "function_call_output")


def item_kind(item: Any) -> str | None:
    """The tag of an input item: its ``type`` (``message`` when absent), ``unsupported`` for any other type.

    >>> item_kind({"role": "user", "content": "Hi"}), item_kind({"type": "input_image"}), item_kind(3)
    ('message', 'unsupported', None)
    """
    if isinstance(item, dict):
        kind = item.get("type", "message")
    elif isinstance(item, BaseModel):
        kind = getattr(item, "type", None)
    else:
        return None
    return kind if kind in SUPPORTED_ITEMS and not isinstance(item, UnsupportedItem) else "unsupported"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[SkipJsonSchema[UnsupportedItem], Tag("unsupported")],
    Discriminator(item_kind),
]


class FunctionTool(StrictModel):
    """``tools[i]``: ``{"type": "function", "name", "description", "parameters", "strict"}``; other tool types
    (web search, file search, ...) are refused by name."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _function_only(cls, value: Any) -> Any:
        if value == "function" or not isinstance(value, str):
            return value
        raise PydanticCustomError("unsupported_tool", "tools of type '{kind}' are not supported; send function "
                                  "tools", {"kind": value})


class FunctionChoice(StrictModel):
    """``tool_choice`` naming the one function to call: ``{"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class TextFormat(StrictModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name`` required; ``schema`` absent: any
    JSON object), enforced by a grammar as chat's ``response_format``."""

    model_config = ConfigDict(json_schema_extra=when({"type": {"const": "json_schema"}}, {"name": {"type": "string"}}))

    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> TextFormat:
        if self.type == "json_schema" and self.name is None:
            raise ValueError("a text.format of type json_schema needs a name")
        return self

    @model_serializer(mode="wrap")
    def _set_members_only(self, handler: SerializerFunctionWrapHandler):  # no return type: keeps the schema
        return {key: value for key, value in handler(self).items() if value is not None}  # {"type": "text"}


class TextConfig(StrictModel):
    """``text``: the output's ``format`` (plain text by default)."""

    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))


class ResponseRequest(StrictModel):
    """``POST /v1/responses`` (module contract). ``store`` keeps the response for ``previous_response_id`` and
    ``GET /v1/responses/{id}``; ``seed`` and ``lookahead`` are this server's extensions, as in chat."""

    model: ServedModel | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: ParallelToolCalls = True
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    seed: Seed | None = None
    lookahead: LookaheadRequest | None = None
    cache_prompt: bool = True


def field_names() -> frozenset[str]:
    """Every request field name of chat and Responses bodies (to render validation error locations)."""
    names = set(protocol_field_names())
    for model in (ResponseRequest, MessageItem, InputTextPart, FunctionCallItem, FunctionCallOutputItem,
                  UnsupportedItem, FunctionTool, FunctionChoice, TextConfig, TextFormat):
        names.update(field.alias or name for name, field in model.model_fields.items())
    return frozenset(names)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """The reply's text, one ``output_text`` part."""

    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    """One call the model made: ``call_id`` is what a ``function_call_output`` answers; ``id`` the item's."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """OpenAI's ``response`` object: the request's settings echoed, ``output`` items, ``usage`` and the
    ``decoding`` extension (both null until it is done)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    error: None = None
    usage: ResponseUsage | None = None
    decoding: DecodingInfo | None = None
