"""Pydantic mirror of the OpenAI API requests the server supports, plus its extensions (their answers:
``server.completion_objects``).

Contract: request models are strict (``"8"`` where an int belongs fails) and ignore unknown fields; their
range checks are the config-independent ones (config-dependent limits such as the lookahead maxima are
checked in ``server.serving``).
Extensions: request fields ``lookahead`` (``LookaheadRequest``), ``top_k``, ``stream_steps`` and vLLM's
sampling fields ``min_p``, ``repetition_penalty``, ``min_tokens`` and ``ignore_eos``; with
``stream_steps`` a stream's content and finish chunks carry one more top-level object, ``step``
(``server.completion_objects.StepInfo``);
vLLM's chat template fields (``ChatTemplateFields``) and its ``/tokenize`` and ``/detokenize`` bodies, which
refuse unknown fields, as ``/v1/memory/corpus``'s body does (``CorpusRequest``, answered by ``CorpusAdded``;
``GET /v1/memory`` by ``MemoryInfo``). Logprobs: chat's ``logprobs`` + ``top_logprobs`` give
``choices[].logprobs.content[]`` (``ChoiceLogprobs``), completions' ``logprobs: int`` the legacy
``CompletionLogprobs``; both the raw model's (before temperature, top-k, top-p), with at most ``MAX_TOP_LOGPROBS``
alternatives. Predicted outputs: chat's and completions' ``prediction`` (``Prediction``) give
``usage.completion_tokens_details``. Completions'
``prompt`` is a string, a list of strings, a list of token ids or a list of lists of token ids (one prompt per
item; ``CompletionRequest.prompt_list``); with several prompts and ``n`` each prompt has ``n`` choices,
``index = prompt_index * n + j``. With ``echo`` a choice's text (and legacy logprobs) start with its prompt's,
the first prompt token's logprob and top alternatives null (``CompletionLogprobs``).
A chat message (``ChatMessage``) is a union by ``role``: ``SystemMessage``, ``DeveloperMessage`` (treated as
system), ``UserMessage``, ``AssistantMessage`` (content may be null; ``tool_calls``) and ``ToolMessage``
(``tool_call_id`` required); a message of another role is a 400 naming ``messages[i].role``; ``chat_message``
builds one. The OpenAPI document takes their schema as pydantic derives it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from decoding.params import MAX_TOP_LOGPROBS
from server.config import REQUEST_LOOKAHEAD

FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function (and json_schema) names
MEDIA_PART_TYPES = ("image_url", "input_audio", "file", "refusal")  # OpenAI's other content parts


class StrictModel(BaseModel):
    """Base of request models: strict types, unknown fields ignored, no NaN or infinity."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextContentPart(StrictModel):
    """A content part: only ``text`` parts are accepted; OpenAI's image, audio and file parts are refused by name
    (400 ``messages[i].content[j].type``), never dropped."""

    type: str
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


class Prediction(StrictModel):
    """Predicted outputs: text the client expects the completion to resemble (e.g. a file it asks to edit).

    ``type`` must be ``"content"``; ``content`` is a string or text parts (joined without separator). Lookahead
    verifies it as a free draft: it changes how fast the completion comes, never what it is.
    """

    type: str
    content: str | list[TextContentPart]

    @field_validator("type", mode="before")
    @classmethod
    def _content_only(cls, value: Any) -> Any:
        if value == "content" or not isinstance(value, str):
            return value
        raise PydanticCustomError("unknown_prediction", "unknown prediction type '{kind}'; expected 'content'",
                                  {"kind": value})

    def text(self) -> str:
        """The predicted text as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema``: OpenAI's ``name`` (1-64 letters, digits, ``_`` or ``-``), ``description``,
    ``schema`` (a JSON schema object; absent: any JSON object) and ``strict`` (the output always matches here,
    strict or not: the schema is enforced by a grammar, see ``decoding.grammar``)."""

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class FunctionDefinition(StrictModel):
    """A tool's function: ``name`` (1-64 letters, digits, ``_`` or ``-``), ``description``, ``parameters`` (a
    JSON schema of its arguments object; absent: any object) and ``strict`` (calls always match here, strict or
    not, when ``tool_choice`` forces a call: see ``server.tools``)."""

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    """``tools[i]``: OpenAI's ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    """``tool_choice`` naming the one function to call: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(StrictModel):
    include_usage: bool = False


LookaheadRequest = create_model(  # the knobs a request may set are the config's REQUEST_LOOKAHEAD, declared there
    "LookaheadRequest",
    __base__=StrictModel,
    __doc__="""Extension: per-request lookahead settings; each field falls back to the server's configured default
    (``enabled``, and the integers of ``server.config.REQUEST_LOOKAHEAD``: W, N and G).

    ``shared_memory: false`` opts the request out of the server-wide n-gram memory: it neither draws candidates
    from it nor adds its completion to it.
    """,
    enabled=(bool | None, None),
    **{name: (int | None, None) for name in REQUEST_LOOKAHEAD},
    shared_memory=(bool | None, None),
)


class GenerationFields(StrictModel):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI (and torch) take it
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    user: str | None = None
    lookahead: LookaheadRequest | None = None
    stream_steps: bool | None = False
    cache_prompt: bool = True

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not item for item in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stop

    def stop_sequences(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        """The completion length the client asked for, if any."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def include_steps(self) -> bool:
        """Extension: stream chunks carry the ``step`` object."""
        return bool(self.stream and self.stream_steps)


class ChatTemplateFields(StrictModel):
    """Extension (vLLM's names): how the conversation is rendered. ``continue_final_message`` continues the last
    (assistant) message instead of starting a new turn, so it excludes ``add_generation_prompt``;
    ``chat_template_kwargs`` are extra variables of the chat template (checked in ``server.serving``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(ChatTemplateFields, GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description="Return each generated token's logprob (the raw model's, before "
                                  "temperature / top-k / top-p) in choices[].logprobs.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="Most likely alternatives per token; needs logprobs: true.")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = Field(True, description="false: at most one call per reply; true: 1 to 8.")
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationFields):
    """``/v1/completions``: ``max_tokens`` may be 0 together with ``echo`` (the prompt and its logprobs only;
    checked in ``server.serving``); ``best_of`` is accepted when null or equal to ``n``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, description="Tokens to generate; 0 only with echo (the prompt alone).")
    echo: bool | None = Field(None, description="Prepend each prompt to its choices' text.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS,
        description="Return each token's logprob and this many alternatives (legacy shape: tokens, token_logprobs, "
        "top_logprobs, text_offset); with echo, the prompt's tokens first (the first one's logprob null).",
    )
    best_of: int | None = None
    suffix: str | None = None
    prediction: Prediction | None = None

    def prompt_list(self) -> list[str] | list[list[int]]:
        """``prompt`` as a list of prompts, each a string or token ids (an empty list stays empty).

        >>> CompletionRequest(prompt=[1, 2]).prompt_list(), CompletionRequest(prompt="a").prompt_list()
        ([[1, 2]], ['a'])
        """
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(item, int) for item in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class TokenizeRequest(ChatTemplateFields):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages``, exactly one. Unknown fields are refused
    (400 naming them), since a misspelt option here would silently change the count."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(StrictModel):
    """``POST /detokenize``: token ids (each below the vocabulary size) to text."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """``GET /tokenizer_info`` (vLLM's): what a client that tokenizes through the server needs."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool | None
    chat_template: str | None
    model_max_length: int


class CorpusRequest(StrictModel):
    """``POST /v1/memory/corpus`` (extension): texts (a codebase's files, documents) added to the server-wide n-gram
    memory, each tokenized without special tokens. Unknown fields are refused (400 naming them)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    documents: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1, description="Texts to add, each non-empty; a long one enters as several memory documents."
    )


class MemoryInfo(BaseModel):
    """``GET /v1/memory`` (extension): the server-wide n-gram memory's stored tokens and documents, of at most
    ``capacity`` tokens (the oldest documents are evicted first); ``enabled`` false, all zero, without one."""

    object: Literal["memory"] = "memory"
    enabled: bool
    tokens: int
    documents: int
    capacity: int


class CorpusAdded(BaseModel):
    """``POST /v1/memory/corpus``'s answer: the memory ``documents`` and ``tokens`` added, and the memory after."""

    object: Literal["memory.corpus"] = "memory.corpus"
    documents: int
    tokens: int
    memory: MemoryInfo


def protocol_field_names() -> set[str]:
    """Every request field name, nested ones included (to render validation error locations)."""
    names: set[str] = set()
    for model in (ChatCompletionRequest, CompletionRequest, AssistantMessage, ToolMessage, TextContentPart,
                  StreamOptions, LookaheadRequest, Prediction, TokenizeRequest, DetokenizeRequest, CorpusRequest,
                  ResponseFormat, JsonSchemaFormat, Tool, FunctionDefinition, NamedToolChoice, NamedFunction, ToolCall,
                  FunctionCall):
        names.update(field.alias or name for name, field in model.model_fields.items())
    return names
