"""``POST /v1/chat/completions``: a chat request turned into plans once, then admitted.

Contract: ``check`` runs on the event loop and needs no model: the model name, the options that cannot work
together without looking at the conversation (``top_logprobs`` without ``logprobs``; the rules across fields are
stated in ``ChatCompletionRequest``'s schema, ``server.protocol``) and ``n`` against the server's
capacity (``serving.check_choices``). ``prepare`` does everything that needs the tokenizer or the grammar compiler
in one call off the event loop: the tool plan (``server.tools.resolve``, once: 400 for tool fields that cannot work
together), the prompt (``chat_prompt``: the chat template as the request's template fields say, tools and tool
messages rendered under the plan), the prediction's ids, the grammar (``response_format``'s or the tool call
grammar, compiled and checked once) and one ``GenerationPlan`` per choice (``serving.plan_choices``, validated
there). ``submit`` chains them and admits the choices. ``server.responses`` decodes on this same path
(``check``, ``plan``), with its own renderer; ``server.tokenization`` renders conversations with ``chat_prompt``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from server import serving, tools
from server.config import ServerConfig
from server.errors import BadRequestError
from server.plans import Asked, GenerationPlan, Prepared
from server.protocol import ChatCompletionRequest, TokenizeRequest
from server.rendering import ChatRenderer
from server.scheduler import Handle
from server.text import ChatTemplateOptions, TemplateError, TextCodec

if TYPE_CHECKING:
    from server.runtime import Runtime

PROMPT_PARAM = "messages"  # the field a 400 about the prompt names


def check(config: ServerConfig, request: ChatCompletionRequest) -> str:
    """The served model's name, after the checks that need no model (module contract); 400 / 404 otherwise."""
    model = serving.check_model(config, request.model)
    if request.top_logprobs is not None and not request.logprobs:
        raise BadRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    serving.check_choices(config, request.n, 1)
    return model


@dataclass(frozen=True)
class ChatPlan:
    """A chat request decided: its choices' plans and its tool plan (None: no call can come)."""

    generations: list[GenerationPlan]
    tools: tools.ToolPlan | None


def plan(loaded: serving.Loaded, request: ChatCompletionRequest, prompt_param: str = PROMPT_PARAM) -> ChatPlan:
    """The tool plan, prompt, prediction, grammar and choices' plans of a chat request, each decided once; 400s
    name the field (a prompt's, ``prompt_param``). Blocking: call it off the event loop."""
    tool_plan = tools.resolve(request)
    prompt = chat_prompt(loaded.codec, request, tool_plan)
    asked = Asked(
        prompts=[prompt], prompt_param=prompt_param, max_tokens=request.requested_max_tokens(),
        top_logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        grammar=serving.output_grammar(loaded, request.response_format, tool_plan),
        prediction=serving.prediction_ids(loaded.codec, request.prediction),
    )
    return ChatPlan(serving.plan_choices(loaded, request, asked), tool_plan)


def prepare(
    loaded: serving.Loaded, request: ChatCompletionRequest, model: str, fingerprint: str | None = None
) -> Prepared:
    """``plan`` and the request's ``ChatRenderer`` (reading replies for calls under its tool plan): one call off
    the event loop."""
    planned = plan(loaded, request)
    renderer = ChatRenderer(model, include_usage=request.include_usage, include_steps=request.include_steps,
                            token_text=loaded.codec.token_text, fingerprint=fingerprint, n=request.n or 1)
    renderer.use_tools(planned.tools)
    return Prepared(planned.generations, renderer)


async def submit(runtime: Runtime, request: ChatCompletionRequest) -> tuple[list[Handle], ChatRenderer]:
    """Check, prepare (off the event loop) and admit one chat request: a handle per choice and its renderer."""
    model = check(runtime.config, request)
    loaded = runtime.require_loaded()
    prepared = await asyncio.to_thread(prepare, loaded, request, model, runtime.fingerprint)
    return serving.start_many(loaded, prepared.generations), prepared.renderer


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
