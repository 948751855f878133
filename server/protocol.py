"""Pydantic mirror of the OpenAI API shapes the server supports, plus its two extensions.

Contract: request models are strict (``"8"`` where an int belongs fails) and ignore unknown fields; their
range checks are the config-independent ones (config-dependent limits such as the lookahead maxima are
checked in ``server.serving``). Response models serialize to exactly OpenAI's shapes (``system_fingerprint``
included), with one extra top-level object, ``decoding`` (``DecodingInfo``), in non-streaming responses and in
a stream's usage chunk.
Extensions: request fields ``lookahead`` (``LookaheadRequest``), ``top_k``, ``stream_steps`` and vLLM's
sampling fields ``min_p``, ``repetition_penalty``, ``min_tokens`` and ``ignore_eos``; with
``stream_steps`` a stream's content and finish chunks carry one more top-level object, ``step`` (``StepInfo``);
vLLM's chat template fields (``ChatTemplateFields``) and its ``/tokenize`` and ``/detokenize`` bodies, which
refuse unknown fields. Logprobs: chat's ``logprobs`` + ``top_logprobs`` give ``choices[].logprobs.content[]``
(``ChoiceLogprobs``), completions' ``logprobs: int`` the legacy ``CompletionLogprobs``; both the raw model's
(before temperature, top-k, top-p), with at most ``MAX_TOP_LOGPROBS`` alternatives. Predicted outputs: chat's
and completions' ``prediction`` (``Prediction``) give ``usage.completion_tokens_details``. Completions'
``prompt`` is a string, a list of strings, a list of token ids or a list of lists of token ids (one prompt per
item; ``CompletionRequest.prompt_list``); with several prompts and ``n`` each prompt has ``n`` choices,
``index = prompt_index * n + j``. With ``echo`` a choice's text (and legacy logprobs) start with its prompt's,
the first prompt token's logprob and top alternatives null (``CompletionLogprobs``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from decoding.params import MAX_TOP_LOGPROBS

FinishReason = Literal["stop", "length", "tool_calls"]
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function (and json_schema) names
MEDIA_PART_TYPES = ("image_url", "input_audio", "file", "refusal")  # OpenAI's other content parts


def _without_none(data: dict[str, Any], key: str) -> dict[str, Any]:
    """``data`` (a serialised model) without ``key`` when its value is None: OpenAI leaves such fields out."""
    if data.get(key) is None:
        data.pop(key, None)
    return data


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


class ChatMessage(StrictModel):
    """One message. ``developer`` is treated as ``system``; ``content`` may be null only for ``assistant``.

    ``tool`` messages carry a tool's result: ``content`` and ``tool_call_id`` (the id of the call it answers;
    its absence is a 400 naming ``messages[i].tool_call_id``, checked in ``server.tools``); ``assistant``
    messages may carry the ``tool_calls`` the model made (their content then may be null).
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined without separator, as OpenAI does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


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


class LookaheadRequest(StrictModel):
    """Extension: per-request lookahead settings; each field falls back to the server's configured default.

    ``shared_memory: false`` opts the request out of the server-wide n-gram memory: it neither draws candidates
    from it nor adds its completion to it.
    """

    enabled: bool | None = None
    window_size: int | None = None
    ngram_size: int | None = None
    guess_set_size: int | None = None
    shared_memory: bool | None = None


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
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationFields):
    """``/v1/completions``: ``max_tokens`` may be 0 together with ``echo`` (the prompt and its logprobs only;
    checked in ``server.serving``); ``best_of`` is accepted when null or equal to ``n``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
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


class CompletionTokensDetails(BaseModel):
    """OpenAI's predicted-output counts: ``accepted_prediction_tokens`` the completion's tokens that lookahead took
    from the prediction (beyond what its other sources proposed), ``rejected_prediction_tokens`` the prediction's
    other tokens (its length minus the accepted ones)."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(BaseModel):
    """Token counts; ``completion_tokens_details`` only when the request sent a prediction (absent otherwise)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _without_empty_details(self, handler: SerializerFunctionWrapHandler):  # no return type: keeps the schema
        return _without_none(handler(self), "completion_tokens_details")


class SourceInfo(BaseModel):
    """Extension: one candidate source's guessed tokens in a completion: the longest of its verified guesses per
    step, summed (``offered_tokens``), and how many of the accepted guesses it proposed (``accepted_tokens``)."""

    offered_tokens: int
    accepted_tokens: int


class DecodingInfo(BaseModel):
    """Extension: how the completion was decoded. W/N/G are null for the autoregressive method. ``seed``: the
    seed a sampled response's tokens were drawn with (the request's, or one drawn at admission; choice j used
    seed + j); send it back to get the same text. Null for greedy decoding. ``sources``: per candidate source
    that offered guesses (``pool``, ``copy``, ``memory``, ``prediction``, ...), its offered and accepted tokens;
    sources overlap (a token two of them proposed counts for both); empty for the autoregressive method."""

    method: Literal["lookahead", "autoregressive"]
    steps: int
    tokens_per_step: float
    accepted_tokens: int
    offered_tokens: int
    window_size: int | None
    ngram_size: int | None
    guess_set_size: int | None
    seed: int | None = None
    sources: dict[str, SourceInfo] = Field(default_factory=dict)


class StepInfo(BaseModel):
    """Extension (``stream_steps``): the tokens behind one stream chunk's text, accepted and offered guesses.

    Normally one decoding step's counts; tokens whose text was held back count in the next chunk with text or
    in the finish chunk, so the ``tokens`` of a stream's chunks add up to ``usage.completion_tokens``.
    """

    tokens: int
    accepted: int
    offered: int


class TopLogprob(BaseModel):
    """One alternative at a token's position: its text, logprob and the UTF-8 bytes of its text."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """One generated token's logprob and the ``top_logprobs`` most likely tokens at its position."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """``choices[].logprobs`` of a chat completion (or of one chunk: its delta's tokens)."""

    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, ``top_logprobs`` as {token text: logprob} per token and
    ``text_offset`` each token's character offset in the choice's text. With ``echo`` the prompt's tokens come
    first; the first prompt token's ``token_logprobs`` and ``top_logprobs`` entries are null (nothing predicts
    it), as in OpenAI's."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ResponseFunctionCall(BaseModel):
    """A call's function in a response: ``arguments`` is the arguments object as JSON text."""

    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    """One tool call the model made: ``id`` is ``call_`` and 24 hex digits, unique per call."""

    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    """The reply: ``content`` is null when the reply is only tool calls; ``tool_calls`` is absent without
    calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_empty_calls(self, handler: SerializerFunctionWrapHandler):  # no return type: keeps the schema
        return _without_none(handler(self), "tool_calls")


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    decoding: DecodingInfo


class DeltaFunctionCall(BaseModel):
    """A piece of a call's function: ``name`` in the call's first delta only, ``arguments`` a fragment of the
    arguments' JSON text (``""`` in the first delta); the fragments of one call concatenate to its arguments."""

    name: str | None = None
    arguments: str


class DeltaToolCall(BaseModel):
    """A piece of one tool call in a stream: ``index`` says which call; ``id`` and ``type`` only in its first
    delta."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    decoding: DecodingInfo | None = None
    step: StepInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage
    decoding: DecodingInfo


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None
    decoding: DecodingInfo | None = None
    step: StepInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lookahead-server"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def chunk_json(chunk: ChatCompletionChunk | CompletionChunk, include_usage: bool) -> str:
    """Serialize a stream chunk as OpenAI does.

    Deltas drop unset fields (``{"content": "Hi"}``); ``usage`` is present (null until the usage chunk) only
    when the client asked for it; ``decoding`` appears only in the usage chunk, ``step`` only when set.
    """
    data: dict[str, Any] = chunk.model_dump(mode="json")
    for choice in data["choices"]:
        if "delta" in choice:
            choice["delta"] = _without_nulls(choice["delta"])
    if not include_usage:
        data.pop("usage")
    for extension in ("decoding", "step"):
        if data.get(extension) is None:
            data.pop(extension)
    return _dumps(data)


def _without_nulls(value: Any) -> Any:
    """``value`` with every null member of its objects dropped, at any depth (deltas carry set fields only)."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def protocol_field_names() -> set[str]:
    """Every request field name, nested ones included (to render validation error locations)."""
    names: set[str] = set()
    for model in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextContentPart, StreamOptions,
                  LookaheadRequest, Prediction, TokenizeRequest, DetokenizeRequest, ResponseFormat, JsonSchemaFormat,
                  Tool, FunctionDefinition, NamedToolChoice, NamedFunction, ToolCall, FunctionCall):
        names.update(field.alias or name for name, field in model.model_fields.items())
    return names
