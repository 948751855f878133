"""The chat messages a request carries (chat completions, the Responses API's input, the tokenizer's bodies).

Contract: a chat message (``ChatMessage``) is a union by ``role``: ``SystemMessage``, ``DeveloperMessage`` (treated
as system), ``UserMessage``, ``AssistantMessage`` (content may be null; ``tool_calls``) and ``ToolMessage``
(``tool_call_id`` required); a message of another role is a 400 naming ``messages[i].role``; ``chat_message`` builds
one. Content is a string or ``text`` parts; OpenAI's media parts (``MEDIA_PART_TYPES``) are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from server.request_base import StrictModel, described

MEDIA_PART_TYPES = ("image_url", "input_audio", "file", "refusal")  # OpenAI's other content parts


class TextContentPart(StrictModel):
    """A content part: only ``text`` parts are accepted; OpenAI's image, audio and file parts are refused by name
    (400 ``messages[i].content[j].type``), never dropped."""

    type: Annotated[str, described(const="text")]
    text: str

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value == "text" or not isinstance(value, str):
            return value  # a non-string fails the strict str check
        if value in MEDIA_PART_TYPES:
            raise PydanticCustomError("unsupported_content", "{kind} content parts are not supported: the served "
                                      "model reads text only; send 'text' parts", {"kind": value})
        raise PydanticCustomError("unknown_content", "unknown content part type '{kind}'; expected 'text'",
                                  {"kind": value})


class FunctionCall(StrictModel):
    """A call's function: its ``name`` and ``arguments``, a JSON object serialised as a string (as OpenAI sends
    them back; the string is not checked here: ``server.tools`` renders an unparsable one as it is)."""

    name: str
    arguments: str


class ToolCall(StrictModel):
    """One tool call of an assistant message in the history (a call the model made earlier)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


MessageContent = str | list[TextContentPart]
ROLES = ("system", "developer", "user", "assistant", "tool")


class _Message(StrictModel):
    """What every chat message has: ``content`` (a string or text parts) and an optional ``name``. ``tool_calls``
    and ``tool_call_id`` read None on the roles that cannot carry them (sent anyway: a 400 in ``server.tools``)."""

    content: MessageContent
    name: str | None = None
    tool_calls: SkipJsonSchema[list[ToolCall] | None] = None
    tool_call_id: SkipJsonSchema[str | None] = None

    def text(self) -> str:
        """The content as one string (text parts joined without separator, as OpenAI does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SystemMessage(_Message):
    role: Literal["system"]


class DeveloperMessage(_Message):
    """Treated as ``system``."""

    role: Literal["developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    """An earlier reply: ``content`` may be null when it made ``tool_calls``."""

    role: Literal["assistant"]
    content: MessageContent | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(_Message):
    """A tool's result: ``tool_call_id`` is the id of the call it answers."""

    role: Literal["tool"]
    tool_call_id: str = Field(min_length=1)


class Message(StrictModel):
    """Where a message of no known role goes, so that the error names ``role`` (never valid here)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]


def _role_tag(value: Any) -> str:
    """The union member a message validates as: its role's, else ``Message``'s (tags are no field names, so
    an error's ``param`` reads ``messages[0].content``)."""
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return f"{role} message" if role in ROLES else "unknown role"


ChatMessage = Annotated[  # one message, typed by its role
    Annotated[SystemMessage, Tag("system message")]
    | Annotated[DeveloperMessage, Tag("developer message")]
    | Annotated[UserMessage, Tag("user message")]
    | Annotated[AssistantMessage, Tag("assistant message")]
    | Annotated[ToolMessage, Tag("tool message")]
    | SkipJsonSchema[Annotated[Message, Tag("unknown role")]],
    Discriminator(_role_tag),
]
MESSAGE_TYPES = {"system": SystemMessage, "developer": DeveloperMessage, "user": UserMessage,
                 "assistant": AssistantMessage, "tool": ToolMessage}


AnyMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


def chat_message(role: str, **fields: Any) -> AnyMessage:
    """A chat message of ``role`` (validated as a request's would be).

    >>> chat_message("tool", content="42", tool_call_id="c1").tool_call_id
    'c1'
    """
    return MESSAGE_TYPES[role].model_validate({"role": role, **fields})
