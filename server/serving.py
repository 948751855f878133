"""OpenAI semantics between the routes and the scheduler: request -> generation plan -> response or stream.

Contract: ``check_model``, ``check_supported``, ``chat_prompt`` / ``completion_prompt`` and ``plan`` check
everything that depends on the server (model name, unsupported options, lookahead maxima, the context window)
and build a ``GenerationPlan``; ``start`` has the decoder validate its decoding parameters (``validate``, the one
check of their ranges: a 400 naming the parameter) and submits it to the scheduler, whose worker runs it in the
decoder's ``batch_engine``. ``prepare`` makes a request's prompts, tool plan, grammar and plans in one call off the
event loop; the responses and chunks themselves are ``server.rendering``'s. ``complete`` waits for the whole
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

Several choices: a request's sequences are its prompts (completions' ``prompt`` list; chat has one) times
``n`` (at most ``max_n``; all of them must fit the running slots plus the queue), each its own generation in the
batch, admitted all or none (``start_many``); choice ``index = prompt_index * n + j``, as OpenAI and vLLM
number them. With a ``seed``, sequence j of each prompt decodes with seed ``seed + j`` (``derived_seed``), so
results are reproducible yet differ; greedy choices are identical. ``usage`` sums over choices, counting each
prompt's tokens once (as vLLM); ``decoding`` sums the choices' counts. A stream interleaves the choices' chunks
(chat: one role chunk per choice first), each with its own finish chunk; the usage chunk comes after the last.
A disconnect, or a failure of one sequence, cancels them all.
Echo (completions): each choice's text starts with its prompt's text (the string sent, or the decoded token
ids); with ``logprobs`` the prompt's tokens come first in the legacy lists, computed by the decoder's prefill
(``SamplingParams.prompt_logprobs``) only then; ``max_tokens: 0`` with echo returns the prompt alone
(finish_reason "length"). A stream sends each choice's prompt in its first content chunk.

``max_tokens`` rule: when a request gives none, it is ``min(default_max_tokens, context_length -
prompt_tokens)``; when it gives one and prompt + max_tokens exceeds the context, the request fails with 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from decoding import (
    ANY_JSON_OBJECT,
    LLAMA_CPP_NUMBERS,
    BatchPolicy,
    Grammar,
    GrammarError,
    InvalidParameterError,
    LookaheadConfig,
    NumberBounds,
    SamplingParams,
    StopCriteria,
    draw_seed,
)
from server import tools
from server.config import LookaheadSettings, ServerConfig, decoder_lookahead, lookahead_bounds
from server.errors import APIError, BadRequestError, InternalError, ModelNotFoundError, to_api_error
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationFields,
    LookaheadRequest,
    TokenizeRequest,
)
from server.rendering import ChatRenderer, CompletionRenderer, Renderer, echo_prompts, step_of
from server.scheduler import Handle, Scheduler
from server.schemas import closed_schema
from server.text import ChatTemplateOptions, TemplateError, TextCodec, TextStream
from server.worker import EngineLike, GenerationPlan, Output, Summary

logger = logging.getLogger("server.serving")
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy decoding
FINGERPRINTED = ("model", "dtype", "quantize", "weight_layout", "lookahead")  # what decides the outputs
INT64 = 1 << 64


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

    def batch_engine(
        self, policy: BatchPolicy | None, memory_tokens: int = 0, memory_file: str | None = None,
        memory_corpus: Sequence[str] = (),
    ) -> EngineLike: ...

    def save_memory(self, engine: EngineLike, memory_file: str) -> int | None: ...


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
    """400 for OpenAI options this server does not implement (rather than silently ignoring them): ``best_of``
    other than null or ``n`` (no server-side ranking), ``suffix``, ``max_tokens: 0`` without ``echo``."""
    if isinstance(request, ChatCompletionRequest):
        check_chat_supported(request)
    if isinstance(request, CompletionRequest):
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise BadRequestError("best_of must be null or equal to n: the server returns every choice it decodes "
                                  "and does not rank them.", param="best_of")
        if request.suffix:
            raise BadRequestError("suffix is not supported.", param="suffix")
        if request.max_tokens == 0 and not request.echo:
            raise BadRequestError("max_tokens must be at least 1 (0 only with echo: the prompt alone).",
                                  param="max_tokens")


def check_choices(config: ServerConfig, n: int | None, prompts: int) -> None:
    """400 naming ``n`` above ``max_n``, and naming ``prompt`` (or ``n``) when the request's sequences (prompts
    times ``n``) could never all fit the running slots plus the queue (``max_running + max_queue``)."""
    n = n or 1
    if n > config.max_n:
        raise BadRequestError(f"n must be at most {config.max_n}, got {n}", param="n")
    capacity = config.max_running + config.max_queue
    if prompts * n > capacity:
        raise BadRequestError(f"this request has {prompts} prompt(s) x n={n} = {prompts * n} sequences; the server "
                              f"holds at most {capacity} at once: split it", param="prompt" if prompts > 1 else "n")


def check_chat_supported(request: ChatCompletionRequest) -> None:
    """400 for ``top_logprobs`` without ``logprobs`` (tool fields that cannot work together are refused where the
    tool plan is resolved, once: ``prepare``)."""
    if request.top_logprobs is not None and not request.logprobs:
        raise BadRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")


def response_grammar(request: GenerationFields, numbers: NumberBounds | None = LLAMA_CPP_NUMBERS) -> Grammar | None:
    """The grammar ``response_format`` asks for: any JSON object for ``json_object`` (and for ``json_schema``
    without a schema), the schema's JSON for ``json_schema`` with its objects closed (``server.schemas``, strict
    rules when ``strict``); None for ``text`` or no ``response_format``. JSON numbers are bounded by ``numbers``."""
    response_format = getattr(request, "response_format", None)
    if response_format is None or response_format.type == "text":
        return None
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.schema_ is None:
        return replace(ANY_JSON_OBJECT, numbers=numbers)
    return Grammar.json_schema(closed_schema(json_schema.schema_, bool(json_schema.strict)), numbers)


def output_grammar(engine: Engine, request: GenerationFields, plan: tools.ToolPlan | None) -> Grammar | None:
    """The grammar the output must match, checked (compiled once: the decode's constraint reuses it):
    ``response_format``'s, or the tool call grammar when ``plan`` (the request's ``tool_plan``) lets calls come
    (``server.tools.grammar``; when it does not compile, each tool's ``parameters`` is checked to give a 400 naming
    the bad one). Call it off the event loop."""
    if plan is None:
        grammar = response_grammar(request, engine.config.number_bounds)
        check_grammar(engine, grammar, "response_format.json_schema.schema")
        return grammar
    grammar = tools.grammar(plan, engine.config.number_bounds)
    try:
        check_grammar(engine, grammar, "tools")
    except BadRequestError:
        for param, parameters in tools.parameter_grammars(plan):
            check_grammar(engine, parameters, param)
        raise
    return grammar


def tool_plan(request: GenerationFields) -> tools.ToolPlan | None:
    """The tool calls a chat request allows (``server.tools.resolve``: 400 for tool fields that cannot work
    together); None for completions."""
    return tools.resolve(request) if isinstance(request, ChatCompletionRequest) else None


@dataclass(frozen=True)
class Prepared:
    """A generation request decided once: its prompts' ids, its tool plan (None: no calls can come) and one
    ``GenerationPlan`` per choice, the grammar compiled and checked."""

    prompts: list[list[int]]
    plan: tools.ToolPlan | None
    generations: list[GenerationPlan]


PromptsOf = Callable[[TextCodec, Any, "tools.ToolPlan | None"], list[list[int]]]


def prepare(engine: Engine, request: GenerationFields, prompts_of: PromptsOf, prompt_param: str) -> Prepared:
    """Everything about a generation request that needs the tokenizer or the grammar compiler, in one call off the
    event loop: the tool plan (resolved once), the prompts (``prompts_of``: ``chat_prompts`` or
    ``completion_prompts``), the prediction's ids, the grammar (``output_grammar``) and the choices' plans
    (``plan_choices``). 400s name the field, as each step does."""
    plan = tool_plan(request)
    prompts = prompts_of(engine.codec, request, plan)
    prediction = prediction_ids(engine.codec, request) if getattr(request, "prediction", None) else None
    grammar = output_grammar(engine, request, plan)
    return Prepared(prompts, plan, plan_choices(engine, request, prompts, prompt_param, prediction, grammar))


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
    ``copy_min_match``, ``copy_candidates``, ``copy_stretch``, ``window_chains``) comes from the config;
    ``shared_memory`` (the server-wide n-gram memory, on unless the request sends false) from the request.

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
    return decoder_lookahead(settings, **values, shared_memory=request.shared_memory is not False)


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


def chat_prompt(
    codec: TextCodec, request: ChatCompletionRequest | TokenizeRequest, plan: tools.ToolPlan | None
) -> list[int]:
    """Render the conversation with the chat template (as its template fields say), tools and tool messages as
    ``server.tools.render`` says under ``plan`` (the request's ``tools.resolve``), and tokenize it."""
    options = template_options(codec, request)
    messages, tool_list = tools.render(request.messages or [], plan, codec.native_tools)
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
    return chat_prompt(codec, request, tools.resolve(request))


def detokenize(codec: TextCodec, request: DetokenizeRequest) -> str:
    """``/detokenize``: the text of ``tokens`` (special tokens skipped, as in responses); 400 naming the first id
    outside the vocabulary."""
    vocab = codec.vocab_size
    for index, token in enumerate(request.tokens):
        if not 0 <= token < vocab:
            raise BadRequestError(f"token id {token} is outside the vocabulary [0, {vocab})", param=f"tokens[{index}]")
    return codec.decode(request.tokens)


def completion_prompts(
    codec: TextCodec, request: CompletionRequest, plan: tools.ToolPlan | None = None
) -> list[list[int]]:
    """The token ids of each prompt (``CompletionRequest.prompt_list``: strings tokenized, token ids checked
    against the vocabulary); 400 for an empty list or an empty prompt in it, naming ``prompt``, or
    ``prompt[i]`` for the i-th prompt of a list of prompts (as validation errors name it). ``plan`` is unused
    (completions call no tools: the signature is ``prepare``'s)."""
    prompts = request.prompt_list()
    if not prompts:
        raise BadRequestError("prompt must not be an empty list", param="prompt")
    several = isinstance(request.prompt, list) and not (request.prompt and isinstance(request.prompt[0], int))
    vocab = codec.vocab_size
    encoded = []
    for index, prompt in enumerate(prompts):
        param = f"prompt[{index}]" if several else "prompt"
        if isinstance(prompt, str):
            ids = codec.encode_text(prompt)
        elif any(not 0 <= token < vocab for token in prompt):
            raise BadRequestError(f"{param}: token ids must lie in [0, {vocab})", param=param)
        else:
            ids = list(prompt)
        if not ids:
            raise BadRequestError(f"{param} is empty: at least one token is required", param=param)
        encoded.append(ids)
    return encoded


def chat_prompts(
    codec: TextCodec, request: ChatCompletionRequest, plan: tools.ToolPlan | None = None
) -> list[list[int]]:
    """The conversation as the request's one prompt (``chat_prompt`` under ``plan``)."""
    return [chat_prompt(codec, request, plan)]


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
        prompt_logprobs=requested_prompt_logprobs(request),
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


def plan_choices(
    engine: Engine, request: GenerationFields, prompts: Sequence[list[int]], prompt_param: str,
    prediction: list[int] | None = None, grammar: Grammar | None = None,
) -> list[GenerationPlan]:
    """One plan per choice (``plan``), in choice order (prompt by prompt, ``n`` each); choice j of a prompt
    decodes with ``derived_seed(seed, j)``. A sampled request without a seed gets one drawn here, at admission
    (``decoding.draw_seed``), so its ``decoding.seed`` replays it."""
    n = request.n or 1
    choices = []
    seed = None
    for prompt_ids in prompts:
        generation = plan(engine, request, prompt_ids, prompt_param, prediction, grammar)
        sampling = generation.sampling
        if seed is None:
            seed = sampling.seed if sampling.seed is not None or sampling.greedy else draw_seed()
        choices += [replace(generation, sampling=replace(sampling, seed=derived_seed(seed, j)))
                    for j in range(n)]
    return choices


def derived_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: ``seed + index`` (vLLM's rule), wrapped into int64; None stays None (greedy).

    >>> derived_seed(7, 2), derived_seed(None, 1), derived_seed(2**63 - 1, 1)
    (9, None, -9223372036854775808)
    """
    if seed is None:
        return None
    return (seed + index + INT64 // 2) % INT64 - INT64 // 2


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


def requested_prompt_logprobs(request: GenerationFields) -> int | None:
    """The decoder's ``prompt_logprobs``: completions' ``logprobs`` when ``echo`` is on, else None (prompt rows
    are never read unless echoed with logprobs)."""
    if isinstance(request, CompletionRequest) and request.echo:
        return request.logprobs
    return None


def start(engine: Engine, generation: GenerationPlan, tracked: bool = True, force: bool = False) -> Handle:
    """Validate with the decoder (400 on bad parameters) and submit to the scheduler (429 / 503 when refused)."""
    return start_many(engine, [generation], tracked, force)[0]


def start_many(
    engine: Engine, generations: Sequence[GenerationPlan], tracked: bool = True, force: bool = False
) -> list[Handle]:
    """``start`` for a request's choices: every one validated first, then all admitted or none."""
    for generation in generations:
        try:
            engine.decoder.validate(generation.prompt_ids, generation.stop, generation.sampling, generation.lookahead)
        except InvalidParameterError:
            raise
        except Exception as exc:
            logger.exception("the decoder refused a request")
            raise InternalError("The server had an error while processing your request.") from exc
    texts = [TextStream(engine.codec.decode, generation.stop_strings) for generation in generations]
    return engine.scheduler.submit_many(list(zip(generations, texts, strict=True)), tracked=tracked, force=force)


def prepare_rendered(
    engine: Engine, request: GenerationFields, prompts_of: PromptsOf, prompt_param: str, model: str,
    fingerprint: str | None = None,
) -> tuple[Prepared, Renderer]:
    """``prepare`` and the request's renderer (``renderer_for``), in one call: one hop off the event loop."""
    prepared = prepare(engine, request, prompts_of, prompt_param)
    return prepared, renderer_for(request, model, engine.codec, prepared, fingerprint)


def renderer_for(
    request: GenerationFields, model: str, codec: TextCodec, prepared: Prepared, fingerprint: str | None = None,
) -> Renderer:
    """The request's renderer: chat (reading replies for calls under the prepared tool plan) or completion, its
    ``n``, and (completions with ``echo``) its prompts."""
    options = dict(include_usage=request.include_usage, include_steps=request.include_steps,
                   token_text=codec.token_text, fingerprint=fingerprint, n=request.n or 1)
    if isinstance(request, CompletionRequest):
        echo = echo_prompts(codec, request, prepared.prompts) if request.echo else None
        return CompletionRenderer(model, echo=echo, **options)
    renderer = ChatRenderer(model, **options)
    renderer.use_tools(prepared.plan)
    return renderer


async def merged(handles: Sequence[Handle]) -> AsyncIterator[tuple[int, Output]]:
    """The outputs of several handles as they come, each with its handle's index; ends once every handle has
    finished; a handle's exception is raised at once."""
    if len(handles) == 1:
        async for output in handles[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: Handle) -> None:
        try:
            async for output in handle:
                queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(index, handle)) for index, handle in enumerate(handles)]
    try:
        running = len(handles)
        while running:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            running -= item.finish_reason is not None
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def stream(handles: Sequence[Handle], renderer: Renderer) -> AsyncIterator[str]:
    """SSE data strings for one streamed request (all its choices); cancels every choice if the client goes
    away or one of them fails."""
    try:
        for index in range(len(handles)):
            opening = renderer.opening(index)
            if opening is not None:
                yield opening
        summaries: list[Summary | None] = [None] * len(handles)
        async with contextlib.aclosing(merged(handles)) as outputs:
            async for index, output in outputs:
                carried = bool(output.text or output.logprobs) or renderer.pending_echo(index)
                if carried:
                    for payload in _payloads(renderer.content(index, output.text, step_of(output),
                                                              output.logprobs, output.prompt_logprobs)):
                        yield payload
                if output.finish_reason is not None:
                    leftover = output if not carried else Output("")  # counts not yet carried by a chunk
                    for payload in _payloads(renderer.finish(index, output.finish_reason, step_of(leftover))):
                        yield payload
                    summaries[index] = output.summary
        if renderer.include_usage and all(summary is not None for summary in summaries):
            yield renderer.usage(summaries)  # type: ignore[arg-type]
        yield "[DONE]"
    except Exception as exc:  # after the 200 went out, an error can only be an event
        yield _json(to_api_error(exc).body())
    finally:
        for handle in handles:
            handle.cancel()


def _payloads(rendered: str | list[str]) -> list[str]:
    """A renderer's chunk, or its chunks (a tool call reply may send several or none per step)."""
    return [rendered] if isinstance(rendered, str) else rendered


async def complete(
    handles: Sequence[Handle], renderer: Renderer, disconnected: Callable[[], Awaitable[None]]
) -> dict[str, Any]:
    """The whole response (every choice); if ``disconnected`` returns first, cancel every choice and raise
    ``ClientGone``; if one choice fails, cancel the others and raise its error."""
    collecting = [asyncio.ensure_future(handle.collect()) for handle in handles]
    result = asyncio.ensure_future(asyncio.gather(*collecting))
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            try:
                choices = result.result()
            except Exception as exc:  # the generation failed (already logged by the worker)
                raise to_api_error(exc) from exc
            return renderer.response(choices)
        raise ClientGone()
    finally:
        watcher.cancel()
        for task in collecting:
            task.cancel()
        result.cancel()
        for handle in handles:
            handle.cancel()
        await asyncio.gather(*collecting, result, return_exceptions=True)  # retrieve what they raised


class ClientGone(APIError):
    """The client disconnected before its response was ready (nobody will read this error)."""

    status = 499
    type = "client_closed_request"

    def __init__(self) -> None:
        super().__init__("client disconnected")


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))
