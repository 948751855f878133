"""``POST /v1/completions``: a text completion request turned into plans once, then admitted.

Contract: ``check`` runs on the event loop and needs no model: the model name, the OpenAI options this server does
not implement (``best_of`` other than null or ``n``: no server-side ranking; ``suffix``; ``max_tokens: 0`` without
``echo``; each stated in ``CompletionRequest``'s schema, ``server.protocol``) and the request's sequences
(prompts times ``n``) against the server's capacity (``serving.check_choices``). ``prepare`` does what needs the
tokenizer in one call off the event loop: each prompt's ids (``prompts``), the prediction's ids, one
``GenerationPlan`` per choice (``serving.plan_choices``, validated there) and the ``CompletionRenderer`` (with
``echo``, each choice's text and logprobs start with its prompt's). Logprobs: ``logprobs`` is the decoder's
``top_logprobs``, and its ``prompt_logprobs`` too when ``echo`` is on (prompt rows are never read otherwise).
``submit`` chains them and admits the choices.

Echo: each choice's text starts with its prompt's text (the string sent, or the decoded token ids); with
``logprobs`` the prompt's tokens come first in the legacy lists, computed by the decoder's prefill only then;
``max_tokens: 0`` with echo returns the prompt alone (finish_reason "length"). A stream sends each choice's prompt
in its first content chunk.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from server import serving
from server.config import ServerConfig
from server.errors import BadRequestError
from server.plans import Asked, Prepared
from server.protocol import CompletionRequest
from server.rendering import CompletionRenderer, echo_prompts
from server.scheduler import Handle
from server.text import TextCodec

if TYPE_CHECKING:
    from server.runtime import Runtime

PROMPT_PARAM = "prompt"  # the field a 400 about the prompt names


def check(config: ServerConfig, request: CompletionRequest) -> str:
    """The served model's name, after the checks that need no model (module contract); 400 / 404 otherwise."""
    model = serving.check_model(config, request.model)
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise BadRequestError("best_of must be null or equal to n: the server returns every choice it decodes "
                              "and does not rank them.", param="best_of")
    if request.suffix:
        raise BadRequestError("suffix is not supported.", param="suffix")
    if request.max_tokens == 0 and not request.echo:
        raise BadRequestError("max_tokens must be at least 1 (0 only with echo: the prompt alone).",
                              param="max_tokens")
    serving.check_choices(config, request.n, len(request.prompt_list()))
    return model


def prompts(codec: TextCodec, request: CompletionRequest) -> list[list[int]]:
    """The token ids of each prompt (``CompletionRequest.prompt_list``: strings tokenized, token ids checked
    against the vocabulary); 400 for an empty list or an empty prompt in it, naming ``prompt``, or
    ``prompt[i]`` for the i-th prompt of a list of prompts (as validation errors name it)."""
    prompt_list = request.prompt_list()
    if not prompt_list:
        raise BadRequestError("prompt must not be an empty list", param="prompt")
    several = isinstance(request.prompt, list) and not (request.prompt and isinstance(request.prompt[0], int))
    vocab = codec.vocab_size
    encoded = []
    for index, prompt in enumerate(prompt_list):
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


def prepare(
    loaded: serving.Loaded, request: CompletionRequest, model: str, fingerprint: str | None = None
) -> Prepared:
    """The prompts, prediction, choices' plans and renderer of a completion request, each decided once;
    400s name the field. Blocking: call it off the event loop."""
    codec = loaded.codec
    encoded = prompts(codec, request)
    asked = Asked(
        prompts=encoded, prompt_param=PROMPT_PARAM, max_tokens=request.requested_max_tokens(),
        top_logprobs=request.logprobs, prompt_logprobs=request.logprobs if request.echo else None,
        prediction=serving.prediction_ids(codec, request.prediction),
    )
    renderer = CompletionRenderer(
        model, include_usage=request.include_usage, include_steps=request.include_steps,
        token_text=codec.token_text, fingerprint=fingerprint, n=request.n or 1,
        echo=echo_prompts(codec, request, encoded) if request.echo else None,
    )
    return Prepared(serving.plan_choices(loaded, request, asked), renderer)


async def submit(runtime: Runtime, request: CompletionRequest) -> tuple[list[Handle], CompletionRenderer]:
    """Check, prepare (off the event loop) and admit one completion request: a handle per choice and its
    renderer."""
    model = check(runtime.config, request)
    loaded = runtime.require_loaded()
    prepared = await asyncio.to_thread(prepare, loaded, request, model, runtime.fingerprint)
    return serving.start_many(loaded, prepared.generations), prepared.renderer
