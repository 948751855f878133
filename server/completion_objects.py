"""The objects chat and text completions answer with (OpenAI's chat completion, completion and chunk objects) in
OpenAI's exact shapes, and the ``/v1/models`` cards. (The Responses API's objects are ``server.responses_protocol``'s.)

Contract: response models serialize to exactly OpenAI's shapes (``system_fingerprint`` included; a field OpenAI
leaves out when empty is left out), with the server's extensions: ``decoding`` (``DecodingInfo``) in non-streaming
responses and in a stream's usage chunk, ``step`` (``StepInfo``) on stream chunks with ``stream_steps``, and
``usage.completion_tokens_details`` with a prediction (``CompletionTokensDetails``). Logprobs: chat's
``choices[].logprobs.content[]`` (``ChoiceLogprobs``), completions' legacy ``CompletionLogprobs``. ``chunk_json``
writes one stream chunk. The requests they answer are ``server.protocol``'s.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

FinishReason = Literal["stop", "length", "tool_calls"]


def _without_none(data: dict[str, Any], key: str) -> dict[str, Any]:
    """``data`` (a serialised model) without ``key`` when its value is None: OpenAI leaves such fields out."""
    if data.get(key) is None:
        data.pop(key, None)
    return data


class CompletionTokensDetails(BaseModel):
    """OpenAI's predicted-output counts: ``accepted_prediction_tokens`` the completion's tokens that lookahead took
    from the prediction (beyond what its other sources proposed), ``rejected_prediction_tokens`` the prediction's
    other tokens (its length minus the accepted ones)."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class PromptTokensDetails(BaseModel):
    """OpenAI's prompt counts: ``cached_tokens``, the prompt tokens whose KV the server reused from an earlier
    request (the prefix cache, ``decoding.step.prefix_cache``) rather than computing them."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts; ``prompt_tokens_details`` always (as OpenAI sends it), ``completion_tokens_details`` only when
    the request sent a prediction (absent otherwise)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
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


class ReplyMessage(BaseModel):
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
    message: ReplyMessage
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
