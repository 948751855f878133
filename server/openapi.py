"""The OpenAPI document (``GET /openapi.json``): the real request and response bodies of every route.

Contract: ``install_openapi(app, config)`` replaces FastAPI's generator with ``openapi_document``, built once the
model is loaded. The document is FastAPI's, derived from the routes: each request body is the route's typed body
(a ``server.protocol`` / ``server.responses_protocol`` model), and the component schemas are pydantic's of those
models (bounds, required fields, descriptions, chat messages as one object per role). This module adds, in one
place (``request_overrides``), what the models cannot say: what only the config knows (the served model names,
``n`` and ``best_of`` up to ``max_n``, at most ``max_stop_strings`` stop strings, the lookahead maxima, token ids
below the vocabulary size once the model is loaded), the rules a field's type does not
state (non-empty stop strings and prompts in OpenAI's four forms, ``logit_bias`` token id keys with biases in
[-100, 100], tool and ``response_format`` shapes with OpenAI's name pattern, no ``suffix``, completions'
``max_tokens`` 0 only with ``echo: true``, ``continue_final_message`` only with ``add_generation_prompt`` false,
``tool_choice`` required or named only with tools, ``/tokenize`` bodies with one of ``prompt`` and ``messages``,
text content parts only), and per route the 200 (JSON, or ``text/event-stream`` for ``stream: true``) and every
error status it can answer with ``ErrorResponse`` (never FastAPI's 422). What no schema can say (``prompt +
max_tokens`` within the model's context, a text that tokenizes to nothing, the variables a chat template reads,
``best_of`` equal to ``n``, prompts times ``n`` within the server's capacity) stays a 400 at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server.completion_objects import ChatCompletion, Completion, ModelCard, ModelList
from server.config import ServerConfig, lookahead_bounds
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CorpusAdded,
    CorpusRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    MemoryInfo,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from server.responses_protocol import ResponseObject, ResponseRequest

REF = "#/components/schemas/{model}"
# A stream's schema: the raw text, or one event as an SSE parser yields it (schemathesis validates each parsed
# event against the stream's schema); each event's data is a JSON chunk, an error object or "[DONE]".
SSE_EVENT = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
        },
    ]
}
SERVICE_STATUSES = ("500", "503")
DESCRIPTION = (
    "OpenAI-compatible completions decoded with lookahead decoding. Extensions: the request field `lookahead` "
    "(per-request W/N/G within the server's maxima), `top_k`, and the response object `decoding`."
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every 4xx and 5xx body."""

    error: ErrorDetail


class HealthStatus(BaseModel):
    """``{"status": "ok"}`` when ready; otherwise the state: loading, warming, draining or failed."""

    status: str


ERROR_DESCRIPTIONS = {
    "400": "Invalid request: bad JSON, wrong types, out-of-range values, context length exceeded.",
    "401": "Missing or wrong API key (when the server has keys).",
    "404": "Unknown model, or (/v1/responses) an unknown stored response.",
    "413": "Request body over the configured limit.",
    "429": "Queue full; retry after Retry-After seconds.",
    "500": "The generation failed (this request only).",
    "503": "Loading, warming up or draining; retry after Retry-After seconds.",
}


OPENAI_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}  # a schema's or a function's name
RESPONSE_FORMAT = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": OPENAI_NAME,
                "description": {"type": "string"},
                "schema": {"type": "object", "description": "A JSON schema; absent: any JSON object."},
                "strict": {"type": "boolean"},
            },
        },
    },
    "description": "Structured output: json_object (any JSON object) or json_schema (JSON matching the schema), "
    "enforced by a grammar at every generated token (strict or not). A schema the grammar cannot enforce is a "
    "400 naming response_format.json_schema.schema.",
}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or null, defaulting to null (the shape pydantic gives ``X | None = None``)."""
    return {"anyOf": [schema, {"type": "null"}], "default": None}


def generation_overrides(config: ServerConfig) -> dict[str, dict[str, Any]]:
    """Property schemas shared by both request models that the pydantic schema alone gets too loose."""
    served = sorted({config.model_name, config.model})
    return {
        "model": nullable({"type": "string", "enum": served}),
        "stop": nullable({"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": config.max_stop_strings},
        ]}),
        "n": nullable({"type": "integer", "minimum": 1, "maximum": config.max_n,
                       "description": "Choices per prompt, decoded side by side; choice j samples with seed + j."}),
        "logit_bias": nullable({
            "type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "description": "token id (a string) -> bias added to its logit at every position",
        }),
    }


def lookahead_schema(config: ServerConfig) -> dict[str, Any]:
    """The ``lookahead`` extension with this server's maxima."""
    properties: dict[str, Any] = {"enabled": nullable({"type": "boolean"})}
    for name, (low, high) in lookahead_bounds(config.lookahead).items():
        properties[name] = nullable({"type": "integer", "minimum": low, "maximum": high})
    properties["shared_memory"] = nullable({"type": "boolean"})
    return {
        "type": "object",
        "title": "LookaheadRequest",
        "description": "Extension: per-request lookahead settings; each field left out takes the server default.",
        "properties": properties,
    }


def prompt_schema(vocab_size: int | None) -> dict[str, Any]:
    """OpenAI's four prompt forms, each prompt non-empty: a string, a list of strings, token ids (below the
    vocabulary size once known), a list of lists of token ids."""
    tokens = {"type": "array", "items": token_id_schema(vocab_size), "minItems": 1}
    return {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        tokens,
        {"type": "array", "items": tokens, "minItems": 1},
    ]}


# Completions' max_tokens may be 0 only with echo (the prompt and its logprobs alone).
ZERO_MAX_TOKENS_NEEDS_ECHO = {
    "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
    "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]},
}


TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": OPENAI_NAME,
                "description": {"type": "string"},
                "parameters": {"type": "object", "description": "A JSON schema of the arguments object; absent: "
                               "any object. One the grammar cannot enforce is a 400 naming "
                               "tools[i].function.parameters."},
                "strict": {"type": "boolean"},
            },
        },
    },
}
TOOL_CHOICE = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "function"],
         "properties": {"type": {"const": "function"}, "function": {
             "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
    ],
    "description": "none (tools left out of the prompt), auto (default with tools: text, or a call enforced by a "
    "grammar once the reply starts with '{'), required or a named function (a call is enforced). A named function "
    "must be among the tools (else 400).",
}
TOOL_CHOICE_NEEDS_TOOLS = {
    "if": {"properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
           "required": ["tool_choice"]},
    "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
}


def token_id_schema(vocab_size: int | None) -> dict[str, Any]:
    """A token id: >= 0, and below the vocabulary size once the model is loaded."""
    token: dict[str, Any] = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token["maximum"] = vocab_size - 1
    return token


CONTINUE_EXCLUDES_GENERATION_PROMPT = {
    "if": {"properties": {"continue_final_message": {"const": True}}, "required": ["continue_final_message"]},
    "then": {"properties": {"add_generation_prompt": {"const": False}}, "required": ["add_generation_prompt"]},
}
TEMPLATE_KWARGS = nullable({
    "type": "object",
    "description": "Extra chat template variables; each key must be a variable the template reads (else 400).",
})


def request_overrides(config: ServerConfig, vocab_size: int | None) -> dict[str, dict[str, dict[str, Any]]]:
    """Per request model: the property schemas that replace pydantic's."""
    shared = generation_overrides(config)
    return {
        "TokenizeRequest": {
            "model": shared["model"],
            "prompt": {"type": "string"},
            "messages": {"type": "array", "items": ref_items("ChatCompletionRequest", "messages"), "minItems": 1},
            "chat_template_kwargs": TEMPLATE_KWARGS,
        },
        "DetokenizeRequest": {
            "model": shared["model"], "tokens": {"type": "array", "items": token_id_schema(vocab_size)},
        },
        "ChatCompletionRequest": {
            **shared,
            "chat_template_kwargs": TEMPLATE_KWARGS,
            "tools": nullable({"type": "array", "items": TOOL, "description": "Functions the model may call; "
                               "see docs/api.md for how they reach a template without tool support."}),
            "tool_choice": nullable(TOOL_CHOICE),
            "response_format": nullable(RESPONSE_FORMAT),
        },
        "ResponseRequest": {"model": shared["model"]},
        "CompletionRequest": {
            **shared,
            "prompt": prompt_schema(vocab_size),
            "best_of": nullable({"type": "integer", "minimum": 1, "maximum": config.max_n,
                                 "description": "Only null or equal to n (choices are not ranked)."}),
            "suffix": nullable({"type": "string", "maxLength": 0}),
        },
    }


def component_schemas(config: ServerConfig, vocab_size: int | None = None) -> dict[str, Any]:
    """Every body model as a named component, request schemas tightened to what the server accepts."""
    request_models = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, CorpusRequest,
                      ResponseRequest)
    requests = [(model, "validation") for model in request_models]
    responses = [
        (model, "serialization")
        for model in (ChatCompletion, Completion, ModelList, ModelCard, ErrorResponse, HealthStatus,
                      TokenizeResponse, DetokenizeResponse, TokenizerInfo, ResponseObject, CorpusAdded, MemoryInfo)
    ]
    _, bundle = models_json_schema([*requests, *responses], ref_template=REF)
    schemas: dict[str, Any] = bundle["$defs"]
    for name, overrides in request_overrides(config, vocab_size).items():
        schemas[name]["properties"].update(overrides)
    schemas["ChatCompletionRequest"].update(CONTINUE_EXCLUDES_GENERATION_PROMPT, allOf=[TOOL_CHOICE_NEEDS_TOOLS])
    schemas["CompletionRequest"].update(ZERO_MAX_TOKENS_NEEDS_ECHO)
    schemas["TokenizeRequest"].update(CONTINUE_EXCLUDES_GENERATION_PROMPT)
    schemas["TokenizeRequest"]["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]
    schemas["TextContentPart"]["properties"]["type"] = {"type": "string", "const": "text"}
    schemas["Prediction"]["properties"]["type"] = {"type": "string", "const": "content"}
    schemas["LookaheadRequest"] = lookahead_schema(config)
    return schemas


def ref_items(model: str, field: str) -> dict[str, Any]:
    """The item schema of a list field of a request model, as pydantic derives it (chat messages: one per role)."""
    from server import protocol

    return getattr(protocol, model).model_json_schema(ref_template=REF)["properties"][field]["items"]


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def json_content(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": ref(name)}}


def error_responses(statuses: tuple[str, ...]) -> dict[str, Any]:
    """The envelope for each status, with ``Retry-After`` where the server sends it."""
    responses: dict[str, Any] = {}
    for status in statuses:
        response: dict[str, Any] = {"description": ERROR_DESCRIPTIONS[status], "content": json_content("ErrorResponse")}
        if status in ("429", "503"):
            response["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
        responses[status] = response
    return responses


def generation_operation(response: str, auth: tuple[str, ...]) -> dict[str, Any]:
    """The responses of one POST generation route (its request body is FastAPI's, from the route's typed body)."""
    return {
        "responses": {
            "200": {
                "description": f"A {response} object, or with stream: true its chunks as server-sent events.",
                "content": {**json_content(response), "text/event-stream": {"schema": SSE_EVENT}},
            },
            **error_responses(("400", *auth, "404", "413", "429", *SERVICE_STATUSES)),
        },
    }


def tool_operation(response: str, auth: tuple[str, ...]) -> dict[str, Any]:
    """The responses of ``/tokenize`` or ``/detokenize`` (no queue: never 429; the body is FastAPI's)."""
    return {
        "responses": {
            "200": {"description": f"A {response} object.", "content": json_content(response)},
            **error_responses(("400", *auth, "404", "413", *SERVICE_STATUSES)),
        },
    }


def operations(config: ServerConfig, protected: bool) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (path, method): the parts of the operation this module owns."""
    auth = ("401",) if protected else ()
    guard_health = ("401",) if protected and config.protect_health else ()
    guard_metrics = ("401",) if protected and config.protect_metrics else ()
    return {
        ("/v1/chat/completions", "post"): generation_operation("ChatCompletion", auth),
        ("/v1/completions", "post"): generation_operation("Completion", auth),
        ("/v1/responses", "post"): generation_operation("ResponseObject", auth),
        ("/v1/responses/{response_id}", "get"): {
            "responses": {"200": {"description": "A stored response.", "content": json_content("ResponseObject")},
                          **error_responses((*auth, "404"))},
        },
        ("/v1/memory/corpus", "post"): {
            "responses": {"200": {"description": "What was added, and the memory after.",
                                  "content": json_content("CorpusAdded")},
                          **error_responses(("400", *auth, "413", *SERVICE_STATUSES))},
        },
        ("/v1/memory", "get"): {
            "responses": {"200": {"description": "The n-gram memory's usage.", "content": json_content("MemoryInfo")},
                          **error_responses((*auth, *SERVICE_STATUSES))},
        },
        ("/tokenize", "post"): tool_operation("TokenizeResponse", auth),
        ("/detokenize", "post"): tool_operation("DetokenizeResponse", auth),
        ("/tokenizer_info", "get"): {
            "responses": {"200": {"description": "The tokenizer.", "content": json_content("TokenizerInfo")},
                          **error_responses((*auth, *SERVICE_STATUSES))},
        },
        ("/v1/models", "get"): {
            "responses": {"200": {"description": "The served model.", "content": json_content("ModelList")},
                          **error_responses(auth)},
        },
        ("/v1/models/{model_id}", "get"): {
            "responses": {"200": {"description": "The served model.", "content": json_content("ModelCard")},
                          **error_responses((*auth, "404"))},
        },
        ("/health", "get"): {
            "responses": {
                "200": {"description": "Ready.", "content": json_content("HealthStatus")},
                "503": {"description": "Not ready, or draining.", "content": json_content("HealthStatus")},
                **error_responses(guard_health),
            },
        },
        ("/metrics", "get"): {
            "responses": {
                "200": {"description": "Prometheus text exposition.",
                        "content": {"text/plain": {"schema": {"type": "string"}}}},
                **error_responses(guard_metrics),
            },
        },
    }


def openapi_document(
    app: FastAPI, config: ServerConfig, protected: bool, vocab_size: int | None = None
) -> dict[str, Any]:
    """FastAPI's document for ``app`` with the bodies and statuses of ``operations``; bearer auth on ``/v1/*``
    (and ``/health`` or ``/metrics`` when protected) when ``protected`` (the server has API keys)."""
    document = get_openapi(title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes)
    components = document.setdefault("components", {})
    components["schemas"] = component_schemas(config, vocab_size)
    if protected:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for (path, method), parts in operations(config, protected).items():
        operation = document["paths"][path][method]
        operation.update(parts)
        if "401" in parts["responses"]:
            operation["security"] = [{"bearer": []}]
    return document


def install_openapi(
    app: FastAPI, config: ServerConfig, protected: bool, vocab_size: Callable[[], int | None] = lambda: None
) -> None:
    """Serve ``openapi_document`` at ``/openapi.json``; cached once ``vocab_size()`` is known (the model loaded)."""

    def cached() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        vocab = vocab_size()
        document = openapi_document(app, config, protected, vocab)
        if vocab is not None:
            app.openapi_schema = document
        return document

    app.openapi = cached  # type: ignore[method-assign]
