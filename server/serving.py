"""What every generation endpoint shares, between its module and the scheduler: planning, admission, the stream loop.

Contract: an endpoint module (``server.chat``, ``server.completions``, ``server.responses``) checks its own request
and decides what only it knows (``server.plans.Asked``); this module holds the rest, so no function here looks at a
request's type. ``check_model`` and ``check_choices`` (on the event loop) check the model name, ``n`` and the
request's sequences against the server; ``output_grammar`` compiles and checks the grammar a request's output must
match (once: the decode's constraint reuses it); ``plan_choices`` builds one ``GenerationPlan`` per choice from the
fields every endpoint shares (``GenerationFields``) over the config: the context window and the ``max_tokens``
rule, stop strings, sampling, logit bias, lookahead (``resolve_lookahead``: within ``lookahead_bounds``), seeds,
and has the decoder validate them there (``validate``, the one check of their ranges, off the event loop: a 400
naming the parameter). ``start_many`` admits a request's planned choices to the scheduler, whose worker runs them
in the decoder's ``batch_engine`` (whose ``add`` re-checks them: the decoder's own guard, no grammar compiled
again). ``complete`` waits for the whole text, cancelling if the client disconnects; ``stream`` yields
the SSE data of OpenAI's chunk sequence through the request's renderer (``server.rendering``): a role chunk (chat
only), one chunk per step that produced text, a finish chunk, the usage chunk when asked, ``[DONE]``; with
``stream_steps`` the content and finish chunks carry a ``step`` object (``step_of``). With logprobs asked for,
each content chunk carries its tokens' logprobs (a chunk whose tokens have no text yet still goes out for them),
so a stream's logprobs reassemble to the non-stream list. An error after the stream started becomes one
``{"error": ...}`` data event. Every response and chunk carries the server's ``system_fingerprint``. Both paths
concatenate the same ``Output`` texts, so a stream and a non-stream give the same text. Every count (``usage``,
``decoding``, ``step``) is read from the ``decoding.StepCounts`` the worker summed.

Several choices: a request's sequences are its prompts (completions' ``prompt`` list; chat has one) times
``n`` (at most ``max_n``; all of them must fit the running slots plus the queue), each its own generation in the
batch, admitted all or none (``start_many``); choice ``index = prompt_index * n + j``, as OpenAI and vLLM
number them. With a ``seed``, sequence j of each prompt decodes with seed ``seed + j`` (``derived_seed``), so
results are reproducible yet differ; greedy choices are identical. ``usage`` sums over choices, counting each
prompt's tokens once (as vLLM); ``decoding`` sums the choices' counts. A stream interleaves the choices' chunks
(chat: one role chunk per choice first), each with its own finish chunk; the usage chunk comes after the last.
A disconnect, or a failure of one sequence, cancels them all.

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
from server.jobs import EngineLike
from server.plans import Asked, GenerationPlan, Output, Renderer, Summary
from server.protocol import GenerationFields, LookaheadRequest, Prediction, ResponseFormat
from server.rendering import step_of
from server.scheduler import Handle, Scheduler
from server.schemas import closed_schema
from server.text import TextCodec, TextStream

logger = logging.getLogger("server.serving")
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy decoding
FINGERPRINTED = ("model", "dtype", "quantize", "weight_layout", "weights", "lookahead")  # what decides the outputs
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
class Loaded:
    """What a request needs once the model is loaded: config, decoder, codec, scheduler. (The engine, the decoder's
    ``decoding.BatchEngine``, is the worker's: requests reach it through the scheduler.)"""

    config: ServerConfig
    decoder: DecoderLike
    codec: TextCodec
    scheduler: Scheduler


def check_model(config: ServerConfig, model: str | None) -> str:
    """The served model name; ``ModelNotFoundError`` if the request names another model."""
    if model is not None and model not in (config.model_name, config.model):
        raise ModelNotFoundError(model)
    return config.model_name


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


def response_grammar(
    response_format: ResponseFormat | None, numbers: NumberBounds | None = LLAMA_CPP_NUMBERS
) -> Grammar | None:
    """The grammar ``response_format`` asks for: any JSON object for ``json_object`` (and for ``json_schema``
    without a schema), the schema's JSON for ``json_schema`` with its objects closed (``server.schemas``, strict
    rules when ``strict``); None for ``text`` or no ``response_format``. JSON numbers are bounded by ``numbers``."""
    if response_format is None or response_format.type == "text":
        return None
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.schema_ is None:
        return replace(ANY_JSON_OBJECT, numbers=numbers)
    return Grammar.json_schema(closed_schema(json_schema.schema_, bool(json_schema.strict)), numbers)


def output_grammar(
    loaded: Loaded, response_format: ResponseFormat | None, plan: tools.ToolPlan | None = None
) -> Grammar | None:
    """The grammar the output must match, checked (compiled once: the decode's constraint reuses it):
    ``response_format``'s, or the tool call grammar when ``plan`` (a chat request's tool plan) lets calls come
    (``server.tools.grammar``; when it does not compile, each tool's ``parameters`` is checked to give a 400 naming
    the bad one). Call it off the event loop."""
    if plan is None:
        grammar = response_grammar(response_format, loaded.config.number_bounds)
        check_grammar(loaded, grammar, "response_format.json_schema.schema")
        return grammar
    grammar = tools.grammar(plan, loaded.config.number_bounds)
    try:
        check_grammar(loaded, grammar, "tools")
    except BadRequestError:
        for param, parameters in tools.parameter_grammars(plan):
            check_grammar(loaded, parameters, param)
        raise
    return grammar


def check_grammar(loaded: Loaded, grammar: Grammar | None, param: str) -> None:
    """400 naming ``param`` when the decoder cannot compile ``grammar`` (a schema it cannot enforce); may take
    a while for a large schema: call it off the event loop."""
    if grammar is None:
        return
    try:
        loaded.decoder.check_grammar(grammar)
    except GrammarError as error:
        raise BadRequestError(f"{param} cannot be enforced: {error}", param=param) from error


def resolve_lookahead(request: LookaheadRequest | None, settings: LookaheadSettings) -> LookaheadConfig | None:
    """The request's lookahead settings over the configured defaults; ``None`` means autoregressive.

    The knobs a request may set (``server.config.REQUEST_LOOKAHEAD``: W, N, G) come from the request when it sends
    them, each within ``lookahead_bounds`` (the decoder's minimum, the configured maximum; 400 naming
    ``lookahead.<field>`` otherwise); every other step setting (``LOOKAHEAD_STEP_FIELDS``: the lazy window,
    ``break_even`` capped at N-1, the copy steps...) from the config (``decoder_lookahead``); ``shared_memory``
    (the server-wide n-gram memory, on unless the request sends false) from the request.
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


def prediction_ids(codec: TextCodec, prediction: Prediction | None) -> list[int] | None:
    """The token ids of a request's ``prediction`` text (no special tokens), None when it sent none."""
    if prediction is None:
        return None
    return codec.encode_text(prediction.text(), add_special_tokens=False)


def plan(loaded: Loaded, request: GenerationFields, asked: Asked, prompt_ids: list[int]) -> GenerationPlan:
    """The decoder's parameters for one prompt of a request: the fields every generation endpoint shares
    (``GenerationFields``) over the config, with what its endpoint decided (``asked``: length, logprobs, grammar,
    prediction)."""
    if not prompt_ids:
        raise BadRequestError("the prompt is empty: at least one token is required", param=asked.prompt_param)
    config = loaded.config
    max_tokens = resolve_max_tokens(
        asked.max_tokens, len(prompt_ids), loaded.decoder.context_length, config.default_max_tokens,
        asked.prompt_param,
    )
    stop_strings = request.stop_sequences()
    if len(stop_strings) > config.max_stop_strings:
        raise BadRequestError(f"at most {config.max_stop_strings} stop sequences are allowed", param="stop")
    sampling = SamplingParams(
        temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        seed=request.seed,
        top_logprobs=asked.top_logprobs,
        min_p=request.min_p or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        logit_bias=resolve_logit_bias(request.logit_bias, loaded.codec.vocab_size),
        grammar=asked.grammar,
        prompt_logprobs=asked.prompt_logprobs,
    )
    eos = frozenset() if request.ignore_eos else frozenset(loaded.decoder.eos_token_ids())
    return GenerationPlan(
        prompt_ids=prompt_ids,
        stop=StopCriteria(max_tokens, eos, request.min_tokens or 0),
        sampling=sampling,
        lookahead=resolve_lookahead(request.lookahead, config.lookahead),
        stop_strings=tuple(stop_strings),
        prediction=None if asked.prediction is None else tuple(asked.prediction),
        cache_prompt=request.cache_prompt,
    )


def plan_choices(loaded: Loaded, request: GenerationFields, asked: Asked) -> list[GenerationPlan]:
    """One plan per choice (``plan``, checked by the decoder: ``validate``), in choice order (prompt by prompt,
    ``n`` each); choice j of a prompt decodes with ``derived_seed(seed, j)``. A sampled request without a seed
    gets one drawn here, before admission (``decoding.draw_seed``), so its ``decoding.seed`` replays it."""
    n = request.n or 1
    choices = []
    seed = None
    for prompt_ids in asked.prompts:
        generation = plan(loaded, request, asked, prompt_ids)
        sampling = generation.sampling
        if seed is None:
            seed = sampling.seed if sampling.seed is not None or sampling.greedy else draw_seed()
        choices += [validate(loaded, replace(generation, sampling=replace(sampling, seed=derived_seed(seed, j))))
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


def start(loaded: Loaded, generation: GenerationPlan, tracked: bool = True, force: bool = False) -> Handle:
    """Submit one planned generation to the scheduler (429 / 503 when refused)."""
    return start_many(loaded, [generation], tracked, force)[0]


def start_many(
    loaded: Loaded, generations: Sequence[GenerationPlan], tracked: bool = True, force: bool = False
) -> list[Handle]:
    """``start`` for a request's choices (planned, so validated, by ``plan_choices``): all admitted or none."""
    texts = [TextStream(loaded.codec.decode, generation.stop_strings) for generation in generations]
    return loaded.scheduler.submit_many(list(zip(generations, texts, strict=True)), tracked=tracked, force=force)


def validate(loaded: Loaded, generation: GenerationPlan) -> GenerationPlan:
    """``generation`` once the decoder has checked its parameters (``Decoder.validate``: 400 naming the field);
    anything else the decoder raises is logged and becomes a 500."""
    try:
        loaded.decoder.validate(generation.prompt_ids, generation.stop, generation.sampling, generation.lookahead)
    except InvalidParameterError:
        raise
    except Exception as exc:
        logger.exception("the decoder refused a request")
        raise InternalError("The server had an error while processing your request.") from exc
    return generation


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
