"""OpenAI semantics between the routes and the scheduler: request -> generation plan -> response or stream.

Contract: ``check_model``, ``check_supported``, ``chat_prompt`` / ``completion_prompt`` and ``plan`` check
everything that depends on the server (model name, unsupported options, lookahead maxima, the context window)
and build a ``GenerationPlan``; ``start`` has the decoder validate its decoding parameters (``validate``, the one
check of their ranges: a 400 naming the parameter) and submits it to the scheduler, whose worker runs it in the
decoder's ``batch_engine``. ``complete`` waits for the whole
text, cancelling if the client disconnects; ``stream`` yields the SSE data of OpenAI's chunk sequence: a role
chunk (chat only), one chunk per step that produced text, a finish chunk, the usage chunk when asked, ``[DONE]``;
with ``stream_steps`` the content and finish chunks carry a ``step`` object (``step_of``). With logprobs
asked for, each content chunk carries its tokens' logprobs (a chunk whose tokens have no text yet still goes
out for them), so a stream's logprobs reassemble to the non-stream list; the token strings are each token's own
text (``TextCodec.token_text``), ``bytes`` its UTF-8 bytes.
An error after the stream started becomes one ``{"error": ...}`` data event. Every response and chunk carries
the server's ``system_fingerprint``. Both paths concatenate the same
``Output`` texts, so a stream and a non-stream give the same text. Every count (``usage``, ``decoding``,
``step``) is read from the ``decoding.StepCounts`` the worker summed.

``max_tokens`` rule: when a request gives none, it is ``min(default_max_tokens, context_length -
prompt_tokens)``; when it gives one and prompt + max_tokens exceeds the context, the request fails with 400.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from decoding import (
    ANY_JSON_OBJECT,
    BatchPolicy,
    Grammar,
    GrammarError,
    InvalidParameterError,
    LookaheadConfig,
    SamplingParams,
    StopCriteria,
    TokenLogprob,
)
from server import tools
from server.config import LookaheadSettings, ServerConfig, lookahead_bounds
from server.errors import APIError, BadRequestError, InternalError, ModelNotFoundError, to_api_error
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatTokenLogprob,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionTokensDetails,
    DecodingInfo,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    GenerationFields,
    LookaheadRequest,
    StepInfo,
    TokenizeRequest,
    TopLogprob,
    Usage,
    chunk_json,
)
from server.scheduler import Handle, Scheduler
from server.text import ChatTemplateOptions, TemplateError, TextCodec, TextStream
from server.worker import EngineLike, GenerationPlan, Output, Summary

logger = logging.getLogger("server.serving")
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy decoding
LOWEST_LOGPROB = -9999.0  # what a logprob of -inf is reported as (JSON has no infinity; OpenAI's floor)
FINGERPRINTED = ("model", "dtype", "quantize", "weight_layout", "lookahead")  # what decides the outputs


def server_version() -> str:
    """The installed ``lookahead-server`` version (``0+unknown`` when run from a tree that is not installed)."""
    try:
        return importlib.metadata.version("lookahead-server")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def system_fingerprint(config: ServerConfig) -> str:
    """OpenAI's ``system_fingerprint``: ``lookahead-server-<version>-<8 hex digits>``, the digits a hash of the
    resolved settings that decide the outputs (``FINGERPRINTED``: model, weights' format, lookahead settings);
    the same for every response of a running server, different when those settings differ."""
    settings = config.model_dump(mode="json", include=set(FINGERPRINTED))
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    return f"lookahead-server-{server_version()}-{digest}"


class DecoderLike(Protocol):
    """What the server needs from ``decoding.Decoder`` (tests may pass a stub)."""

    tokenizer: Any
    context_length: int
    device: str
    dtype: str
    linears: str  # what runs the linear layers: "torch", "packed" or "int8"

    def eos_token_ids(self) -> frozenset[int]: ...

    def validate(
        self,
        prompt_ids: Sequence[int],
        stop: StopCriteria,
        sampling: SamplingParams,
        lookahead: LookaheadConfig | None,
    ) -> None: ...

    def check_grammar(self, grammar: Grammar) -> None: ...

    def batch_engine(self, policy: BatchPolicy | None, memory_tokens: int = 0) -> EngineLike: ...


@dataclass(frozen=True)
class Engine:
    """The loaded pieces a request needs: config, decoder, codec, scheduler."""

    config: ServerConfig
    decoder: DecoderLike
    codec: TextCodec
    scheduler: Scheduler


def check_model(config: ServerConfig, model: str | None) -> str:
    """The served model name; ``ModelNotFoundError`` if the request names another model."""
    if model is not None and model not in (config.model_name, config.model):
        raise ModelNotFoundError(model)
    return config.model_name


def check_supported(request: GenerationFields) -> None:
    """400 for OpenAI options this server does not implement (rather than silently ignoring them)."""
    if request.n not in (None, 1):
        raise BadRequestError("n > 1 is not supported; send n = 1 and repeat the request instead.", param="n")
    if isinstance(request, ChatCompletionRequest):
        check_chat_supported(request)
    if isinstance(request, CompletionRequest):
        if request.echo and request.logprobs is not None:
            raise BadRequestError(
                "echo with logprobs is not supported: prompt logprobs are not computed; leave echo out.", param="echo"
            )
        if request.echo:
            raise BadRequestError("echo is not supported.", param="echo")
        if request.best_of not in (None, 1):
            raise BadRequestError("best_of > 1 is not supported.", param="best_of")
        if request.suffix:
            raise BadRequestError("suffix is not supported.", param="suffix")


def check_chat_supported(request: ChatCompletionRequest) -> None:
    """400 for ``top_logprobs`` without ``logprobs`` and for tool fields that cannot work together
    (``server.tools.resolve``)."""
    if request.top_logprobs is not None and not request.logprobs:
        raise BadRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    tools.resolve(request)


def response_grammar(request: GenerationFields) -> Grammar | None:
    """The grammar ``response_format`` asks for: any JSON object for ``json_object`` (and for ``json_schema``
    without a schema), the schema's JSON for ``json_schema``; None for ``text`` or no ``response_format``."""
    response_format = getattr(request, "response_format", None)
    if response_format is None or response_format.type == "text":
        return None
    schema = response_format.json_schema.schema_ if response_format.json_schema is not None else None
    return ANY_JSON_OBJECT if schema is None else Grammar.json_schema(schema)


def output_grammar(engine: Engine, request: GenerationFields) -> Grammar | None:
    """The grammar the output must match, checked: ``response_format``'s, or the tool call grammar when calls
    can come (``server.tools.grammar``; each tool's ``parameters`` checked first, a 400 naming the bad one). Call
    it off the event loop."""
    plan = tool_plan(request)
    if plan is None:
        grammar = response_grammar(request)
        check_grammar(engine, grammar, "response_format.json_schema.schema")
        return grammar
    for param, parameters in tools.parameter_grammars(plan):
        check_grammar(engine, parameters, param)
    grammar = tools.grammar(plan)
    check_grammar(engine, grammar, "tools")
    return grammar


def tool_plan(request: GenerationFields) -> tools.ToolPlan | None:
    """The tool calls a chat request allows (``server.tools.resolve``); None for completions."""
    return tools.resolve(request) if isinstance(request, ChatCompletionRequest) else None


def check_grammar(engine: Engine, grammar: Grammar | None, param: str) -> None:
    """400 naming ``param`` when the decoder cannot compile ``grammar`` (a schema it cannot enforce); may take
    a while for a large schema: call it off the event loop."""
    if grammar is None:
        return
    try:
        engine.decoder.check_grammar(grammar)
    except GrammarError as error:
        raise BadRequestError(f"{param} cannot be enforced: {error}", param=param) from error


def resolve_lookahead(request: LookaheadRequest | None, settings: LookaheadSettings) -> LookaheadConfig | None:
    """The request's lookahead settings over the configured defaults; ``None`` means autoregressive.

    The server-wide step policy (``lazy_window``, ``break_even``, capped at N-1, ``copy_length``,
    ``copy_min_match``, ``copy_candidates``) comes from the config; ``shared_memory`` (the server-wide n-gram
    memory, on unless the request sends false) from the request.

    Each value must lie in ``lookahead_bounds``: the decoder's minimum, the configured maximum (400 naming
    ``lookahead.<field>`` otherwise).
    """
    request = request or LookaheadRequest()
    values: dict[str, int] = {}
    for name, (low, high) in lookahead_bounds(settings).items():
        value = getattr(request, name)
        value = getattr(settings, name) if value is None else value
        if not low <= value <= high:
            raise BadRequestError(
                f"lookahead.{name} must be an integer in [{low}, {high}], got {value}", param=f"lookahead.{name}"
            )
        values[name] = value
    enabled = settings.enabled if request.enabled is None else request.enabled
    if not enabled:
        return None
    break_even = min(settings.break_even, values["ngram_size"] - 1)
    return LookaheadConfig(
        **values, lazy_window=settings.lazy_window, break_even=break_even, copy_length=settings.copy_length,
        copy_min_match=settings.copy_min_match, copy_candidates=settings.copy_candidates,
        shared_memory=request.shared_memory is not False,
    )


def resolve_max_tokens(
    requested: int | None, prompt_tokens: int, context_length: int, default: int, prompt_param: str
) -> int:
    """Apply the max_tokens rule (module docstring); 400 ``context_length_exceeded`` when nothing fits.

    >>> resolve_max_tokens(None, 100, 2048, 512, "messages"), resolve_max_tokens(None, 2000, 2048, 512, "messages")
    (512, 48)
    """
    room = context_length - prompt_tokens
    if room < 1:
        raise BadRequestError(
            f"This model's maximum context length is {context_length} tokens; the prompt has {prompt_tokens} "
            "tokens, which leaves no room for a completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return min(default, room)
    if requested > room:
        raise BadRequestError(
            f"This model's maximum context length is {context_length} tokens; the prompt has {prompt_tokens} "
            f"tokens and max_tokens is {requested}. Lower max_tokens to at most {room}.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def template_options(codec: TextCodec, request: ChatCompletionRequest | TokenizeRequest) -> ChatTemplateOptions:
    """The request's chat template fields, checked: 400 when ``continue_final_message`` comes with
    ``add_generation_prompt`` or without a last assistant message with text, or when a ``chat_template_kwargs``
    key is one the renderer sets itself (``server.text.reserved_variables``). Other keys go to the template; one
    it does not read changes nothing, as in vLLM and llama.cpp (clients send e.g. ``enable_thinking`` to every
    model)."""
    messages = request.messages or []
    if request.continue_final_message:
        if request.add_generation_prompt:
            raise BadRequestError("continue_final_message and add_generation_prompt cannot both be true; send "
                                  "add_generation_prompt: false to continue the last message",
                                  param="continue_final_message")
        last = len(messages) - 1
        if messages[last].role != "assistant":
            raise BadRequestError("continue_final_message continues the last message, which must be the "
                                  f"assistant's (it is {messages[last].role!r})", param=f"messages[{last}].role")
        if not messages[last].text():
            raise BadRequestError("the assistant message to continue has no text", param=f"messages[{last}].content")
    variables = request.chat_template_kwargs or {}
    for name in variables:
        if name in codec.reserved_variables:
            readable = ", ".join(sorted(codec.template_variables)) or "none"
            raise BadRequestError(f"{name!r} is set by the server and cannot be a chat_template_kwargs key (this "
                                  f"template reads: {readable})", param=f"chat_template_kwargs.{name}")
    return ChatTemplateOptions(request.add_generation_prompt, request.continue_final_message, dict(variables))


def chat_prompt(codec: TextCodec, request: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    """Render the conversation with the chat template (as its template fields say), tools and tool messages as
    ``server.tools.render`` says, and tokenize it."""
    options = template_options(codec, request)
    messages, tool_list = tools.render(request.messages or [], tools.resolve(request), codec.native_tools)
    try:
        return codec.encode_chat(messages, options, tool_list)
    except TemplateError as exc:
        raise BadRequestError(str(exc), param="messages") from exc


def tokenize_prompt(codec: TextCodec, request: TokenizeRequest) -> list[int]:
    """``/tokenize``: the ids of ``prompt`` (as a completion would see it) or of ``messages`` (as a chat would);
    400 unless exactly one of them is given."""
    if (request.prompt is None) == (request.messages is None):
        raise BadRequestError("send exactly one of prompt and messages", param="prompt")
    if request.prompt is not None:
        return codec.encode_text(request.prompt, request.add_special_tokens)
    return chat_prompt(codec, request)


def detokenize(codec: TextCodec, request: DetokenizeRequest) -> str:
    """``/detokenize``: the text of ``tokens`` (special tokens skipped, as in responses); 400 naming the first id
    outside the vocabulary."""
    vocab = codec.vocab_size
    for index, token in enumerate(request.tokens):
        if not 0 <= token < vocab:
            raise BadRequestError(f"token id {token} is outside the vocabulary [0, {vocab})", param=f"tokens[{index}]")
    return codec.decode(request.tokens)


def completion_prompt(codec: TextCodec, request: CompletionRequest) -> list[int]:
    """One prompt: a string, a list holding one string, or a list of token ids (checked against the vocab)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return codec.encode_text(prompt)
    if prompt and all(isinstance(item, int) for item in prompt):
        vocab = codec.vocab_size
        if any(not 0 <= token < vocab for token in prompt):
            raise BadRequestError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
        return list(prompt)
    if len(prompt) == 1:
        return codec.encode_text(prompt[0])
    raise BadRequestError("exactly one prompt per request is supported", param="prompt")


def prediction_ids(codec: TextCodec, request: GenerationFields) -> list[int] | None:
    """The token ids of the request's ``prediction`` text (no special tokens), None when it sent none."""
    prediction = getattr(request, "prediction", None)
    if prediction is None:
        return None
    return codec.encode_text(prediction.text(), add_special_tokens=False)


def plan(
    engine: Engine, request: GenerationFields, prompt_ids: list[int], prompt_param: str,
    prediction: list[int] | None = None,
    grammar: Grammar | None = None,
) -> GenerationPlan:
    """Build the decoder's parameters from the request and the config (``prediction``: its predicted output's
    token ids, see ``prediction_ids``; ``grammar``: what the output must match, checked by ``check_grammar``)."""
    if not prompt_ids:
        raise BadRequestError("the prompt is empty: at least one token is required", param=prompt_param)
    config = engine.config
    max_tokens = resolve_max_tokens(
        request.requested_max_tokens(), len(prompt_ids), engine.decoder.context_length, config.default_max_tokens,
        prompt_param,
    )
    stop_strings = request.stop_sequences()
    if len(stop_strings) > config.max_stop_strings:
        raise BadRequestError(f"at most {config.max_stop_strings} stop sequences are allowed", param="stop")
    sampling = SamplingParams(
        temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        seed=request.seed,
        top_logprobs=requested_top_logprobs(request),
        min_p=request.min_p or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        logit_bias=resolve_logit_bias(request.logit_bias, engine.codec.vocab_size),
        grammar=grammar,
    )
    eos = frozenset() if request.ignore_eos else frozenset(engine.decoder.eos_token_ids())
    return GenerationPlan(
        prompt_ids=prompt_ids,
        stop=StopCriteria(max_tokens, eos, request.min_tokens or 0),
        sampling=sampling,
        lookahead=resolve_lookahead(request.lookahead, config.lookahead),
        stop_strings=tuple(stop_strings),
        prediction=None if prediction is None else tuple(prediction),
    )


def resolve_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id strings -> bias) as the decoder's sorted (id, bias) pairs; 400 naming
    ``logit_bias`` for a key that is not a token id below ``vocab_size`` (the bias range is the decoder's check).

    >>> resolve_logit_bias({"7": -100, "3": 2.5}, 10)
    ((3, 2.5), (7, -100.0))
    """
    pairs = []
    for key, bias in (logit_bias or {}).items():
        token = int(key) if key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise BadRequestError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                                  param="logit_bias")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def requested_top_logprobs(request: GenerationFields) -> int | None:
    """The decoder's ``top_logprobs``: None when the request wants no logprobs, else its alternatives per token
    (chat: ``top_logprobs`` once ``logprobs`` is true, 0 by default; completions: ``logprobs`` itself)."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    if isinstance(request, CompletionRequest):
        return request.logprobs
    return None


def start(engine: Engine, generation: GenerationPlan, tracked: bool = True, force: bool = False) -> Handle:
    """Validate with the decoder (400 on bad parameters) and submit to the scheduler (429 / 503 when refused)."""
    try:
        engine.decoder.validate(generation.prompt_ids, generation.stop, generation.sampling, generation.lookahead)
    except InvalidParameterError:
        raise
    except Exception as exc:
        logger.exception("the decoder refused a request")
        raise InternalError("The server had an error while processing your request.") from exc
    text = TextStream(engine.codec.decode, generation.stop_strings)
    return engine.scheduler.submit(generation, text, tracked=tracked, force=force)


def usage_of(summary: Summary) -> Usage:
    """OpenAI's ``usage``; with a prediction, its accepted tokens and the rest of it as rejected."""
    details = None
    if summary.prediction_tokens is not None:
        accepted = summary.counts.prediction_accepted
        details = CompletionTokensDetails(
            accepted_prediction_tokens=accepted,
            rejected_prediction_tokens=max(0, summary.prediction_tokens - accepted),
        )
    return Usage(
        prompt_tokens=summary.prompt_tokens,
        completion_tokens=summary.counts.tokens,
        total_tokens=summary.prompt_tokens + summary.counts.tokens,
        completion_tokens_details=details,
    )


def decoding_of(summary: Summary) -> DecodingInfo:
    """The ``decoding`` extension object."""
    lookahead, counts = summary.lookahead, summary.counts
    return DecodingInfo(
        method="lookahead" if lookahead is not None else "autoregressive",
        steps=counts.steps,
        tokens_per_step=round(counts.tokens / counts.steps, 4) if counts.steps else 0.0,
        accepted_tokens=counts.accepted,
        offered_tokens=counts.offered,
        window_size=lookahead.window_size if lookahead else None,
        ngram_size=lookahead.ngram_size if lookahead else None,
        guess_set_size=lookahead.guess_set_size if lookahead else None,
    )


def step_of(output: Output) -> StepInfo:
    """The ``step`` extension object of the chunk that carries ``output``'s text."""
    counts = output.counts
    return StepInfo(tokens=counts.tokens, accepted=counts.accepted, offered=counts.offered)


class Renderer(Protocol):
    """Builds one endpoint's response and chunks; ``step`` objects are dropped unless ``include_steps``;
    ``logprobs`` (None: not asked for) are the tokens behind the text."""

    include_usage: bool

    def response(self, text: str, last: Output) -> dict[str, Any]: ...

    def opening(self) -> str | None: ...

    def content(
        self, text: str, step: StepInfo | None = None, logprobs: Sequence[TokenLogprob] | None = None
    ) -> list[str]: ...

    def finish(self, reason: str, step: StepInfo | None = None) -> list[str]: ...

    def usage(self, summary: Summary) -> str: ...


class _Identity:
    """The id, creation time and model name shared by every chunk of one response; ``token_text`` names a token
    id in logprobs (``TextCodec.token_text``; its decimal id when not given)."""

    id_prefix = ""
    chunk_type: type[ChatCompletionChunk] | type[CompletionChunk]

    def __init__(
        self, model: str, include_usage: bool, include_steps: bool = False,
        token_text: Callable[[int], str] | None = None, fingerprint: str | None = None,
    ) -> None:
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        self.include_steps = include_steps
        self.token_text = token_text or str

    def _chunk(self, choices: list[Any], summary: Summary | None = None, step: StepInfo | None = None) -> str:
        """One SSE ``data`` payload of this response's chunk type (usage only on the usage chunk)."""
        chunk = self.chunk_type(
            id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint, choices=choices
        )
        if summary is not None:
            chunk.usage, chunk.decoding = usage_of(summary), decoding_of(summary)
        if self.include_steps:
            chunk.step = step
        return chunk_json(chunk, self.include_usage)


class ChatRenderer(_Identity):
    """``chat.completion`` and ``chat.completion.chunk`` objects; with ``use_tools``, the reply is read for tool
    calls (``server.tools``): a stream sends one chunk per content piece or ``delta.tool_calls`` entry, the
    step's logprobs and ``step`` on its first chunk (an empty delta carries logprobs when a step sends nothing
    else; its ``step`` counts then wait for the next chunk)."""

    id_prefix = "chatcmpl-"
    chunk_type = ChatCompletionChunk
    _plan: tools.ToolPlan | None = None
    _tools: tools.ToolStream | None = None
    _held: StepInfo | None = None  # counts of steps that sent no chunk yet

    def use_tools(self, plan: tools.ToolPlan | None) -> None:
        """Read the reply for tool calls under ``plan`` (None: plain text)."""
        self._plan = plan
        self._tools = tools.ToolStream(plan) if plan is not None else None

    def response(self, text: str, last: Output) -> dict[str, Any]:
        assert last.summary is not None and last.finish_reason is not None
        message, reason = AssistantMessage(content=text), last.finish_reason
        if self._plan is not None:
            content, calls = tools.reply(self._plan, text)
            message, reason = AssistantMessage(content=content, tool_calls=calls), tools.finish_reason(
                reason, len(calls or []))
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=[ChatChoice(message=message, logprobs=self._logprobs(last.logprobs), finish_reason=reason)],
            usage=usage_of(last.summary),
            decoding=decoding_of(last.summary),
        ).model_dump(mode="json")

    def opening(self) -> str | None:
        return self._chunk([ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))])

    def content(
        self, text: str, step: StepInfo | None = None, logprobs: Sequence[TokenLogprob] | None = None
    ) -> list[str]:
        if self._tools is not None:
            return self._pieces(self._tools.feed(text), step, logprobs)
        choice = ChatChunkChoice(delta=DeltaMessage(content=text), logprobs=self._logprobs(logprobs))
        return [self._chunk([choice], step=step)]

    def _pieces(
        self, pieces: Sequence[str | DeltaToolCall], step: StepInfo | None, logprobs: Sequence[TokenLogprob] | None
    ) -> list[str]:
        """One chunk per content piece or tool call delta (class docstring)."""
        deltas = [DeltaMessage(content=piece) if isinstance(piece, str) else DeltaMessage(tool_calls=[piece])
                  for piece in pieces]
        if not deltas and logprobs is None:
            self._held = _added(self._held, step)
            return []
        step, self._held = _added(self._held, step), None
        chunks = []
        for index, delta in enumerate(deltas or [DeltaMessage()]):
            choice = ChatChunkChoice(delta=delta, logprobs=self._logprobs(logprobs) if index == 0 else None)
            chunks.append(self._chunk([choice], step=step if index == 0 else None))
        return chunks

    def _logprobs(self, logprobs: Sequence[TokenLogprob] | None) -> ChoiceLogprobs | None:
        """OpenAI's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` for these tokens."""
        if logprobs is None:
            return None
        content = [
            ChatTokenLogprob(**_top_logprob(self.token_text, entry.token_id, entry.logprob).model_dump(),
                             top_logprobs=[_top_logprob(self.token_text, *pair) for pair in entry.top])
            for entry in logprobs
        ]
        return ChoiceLogprobs(content=content)

    def finish(self, reason: str, step: StepInfo | None = None) -> list[str]:
        chunks: list[str] = []
        if self._tools is not None:
            chunks = self._pieces(self._tools.close(), None, None)
            reason, step, self._held = tools.finish_reason(reason, self._tools.calls), _added(self._held, step), None
        return [*chunks, self._chunk([ChatChunkChoice(delta=DeltaMessage(), finish_reason=reason)], step=step)]

    def usage(self, summary: Summary) -> str:
        return self._chunk([], summary)


def _added(first: StepInfo | None, second: StepInfo | None) -> StepInfo | None:
    """The counts of both (either may be None)."""
    if first is None or second is None:
        return first or second
    return StepInfo(tokens=first.tokens + second.tokens, accepted=first.accepted + second.accepted,
                    offered=first.offered + second.offered)


class CompletionRenderer(_Identity):
    """``text_completion`` objects, whole and chunked."""

    id_prefix = "cmpl-"
    chunk_type = CompletionChunk
    _offset = 0  # characters of token text rendered so far (per response: set on the instance once it grows)

    def response(self, text: str, last: Output) -> dict[str, Any]:
        assert last.summary is not None and last.finish_reason is not None
        return Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=[CompletionChoice(text=text, logprobs=self._logprobs(last.logprobs),
                                      finish_reason=last.finish_reason)],
            usage=usage_of(last.summary),
            decoding=decoding_of(last.summary),
        ).model_dump(mode="json")

    def opening(self) -> str | None:
        return None

    def content(
        self, text: str, step: StepInfo | None = None, logprobs: Sequence[TokenLogprob] | None = None
    ) -> list[str]:
        return [self._chunk([CompletionChoice(text=text, logprobs=self._logprobs(logprobs))], step=step)]

    def _logprobs(self, logprobs: Sequence[TokenLogprob] | None) -> CompletionLogprobs | None:
        """The legacy shape for these tokens; ``text_offset`` counts characters of token texts from the start of
        the completion (it runs on across a stream's chunks)."""
        if logprobs is None:
            return None
        texts = [self.token_text(entry.token_id) for entry in logprobs]
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        return CompletionLogprobs(
            tokens=texts,
            token_logprobs=[_reported(entry.logprob) for entry in logprobs],
            top_logprobs=[{self.token_text(token): _reported(value) for token, value in entry.top}
                          for entry in logprobs],
            text_offset=offsets,
        )

    def finish(self, reason: str, step: StepInfo | None = None) -> list[str]:
        return [self._chunk([CompletionChoice(text="", finish_reason=reason)], step=step)]

    def usage(self, summary: Summary) -> str:
        return self._chunk([], summary)


async def stream(handle: Handle, renderer: Renderer) -> AsyncIterator[str]:
    """SSE data strings for one streamed request; cancels the request if the client goes away."""
    try:
        opening = renderer.opening()
        if opening is not None:
            yield opening
        async for output in handle:
            carried = bool(output.text or output.logprobs)
            if carried:
                for payload in renderer.content(output.text, step_of(output), output.logprobs):
                    yield payload
            if output.finish_reason is not None:
                leftover = output if not carried else Output("")  # counts not yet carried by a chunk
                for payload in renderer.finish(output.finish_reason, step_of(leftover)):
                    yield payload
                if renderer.include_usage and output.summary is not None:
                    yield renderer.usage(output.summary)
        yield "[DONE]"
    except Exception as exc:  # after the 200 went out, an error can only be an event
        yield _json(to_api_error(exc).body())
    finally:
        handle.cancel()


async def complete(
    handle: Handle, renderer: Renderer, disconnected: Callable[[], Awaitable[None]]
) -> dict[str, Any]:
    """The whole response; if ``disconnected`` returns first, cancel the request and raise ``ClientGone``."""
    result = asyncio.ensure_future(handle.collect())
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            try:
                text, last = result.result()
            except Exception as exc:  # the generation failed (already logged by the worker)
                raise to_api_error(exc) from exc
            return renderer.response(text, last)
        handle.cancel()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not result.done():
            result.cancel()
        handle.cancel()


class ClientGone(APIError):
    """The client disconnected before its response was ready (nobody will read this error)."""

    status = 499
    type = "client_closed_request"

    def __init__(self) -> None:
        super().__init__("client disconnected")


def _reported(logprob: float) -> float:
    """A logprob as JSON can carry it (-inf becomes ``LOWEST_LOGPROB``)."""
    return max(logprob, LOWEST_LOGPROB)


def _top_logprob(token_text: Callable[[int], str], token_id: int, logprob: float) -> TopLogprob:
    """One token's ``{token, logprob, bytes}``: its text and that text's UTF-8 bytes."""
    text = token_text(token_id)
    return TopLogprob(token=text, logprob=_reported(logprob), bytes=list(text.encode("utf-8")))


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))
