"""The OpenAPI document (``GET /openapi.json``): FastAPI's, from the routes, with the server's settings filled in.

Contract: ``install_openapi(app, config, vocab_size)`` replaces FastAPI's generator with ``openapi_document``, cached
once the model is loaded. The document comes from the routes: each request body is the route's typed body (a
``server.protocol`` / ``server.responses_protocol`` model, whose field types and rules carry their JSON schema),
each route declares its reply (``response_model``, and ``text/event-stream`` for a stream: ``server.sse.STREAMED``)
and the error statuses it answers (``server.errors.error_responses``: OpenAI's envelope); the component schemas are
pydantic's own of the models the routes name (``route_models``: FastAPI's copy of them turns integer bounds into
floats and drops ``default: null``). This module adds only what the configuration and the model decide: the value
of each schema keyword a model marks as a setting (``protocol.configured``: the served model names, ``n`` and
``best_of`` up to ``max_n``, ``max_stop_strings``, the lookahead bounds, token ids below the vocabulary size once
the model is loaded), the bearer scheme on the operations that answer 401 (the server has API keys), and no 422
(FastAPI documents one for every route with parameters; a validation error is a 400 here). What no schema can say
(``prompt + max_tokens`` within the model's context, a text that tokenizes to nothing, the variables a chat
template reads, ``best_of`` equal to ``n``, prompts times ``n`` within the server's capacity, a named tool among
the tools) stays a 400 at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_fields_from_routes, get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from server.config import ServerConfig, lookahead_bounds
from server.request_base import SETTINGS_KEY

DESCRIPTION = (
    "OpenAI-compatible completions decoded with lookahead decoding. Extensions: the request field `lookahead` "
    "(per-request W/N/G within the server's maxima), `top_k`, and the response object `decoding`."
)
REF = "#/components/schemas/{model}"
BEARER = {"bearer": {"type": "http", "scheme": "bearer"}}


def settings(config: ServerConfig, vocab_size: int | None) -> dict[str, Any]:
    """The value of each setting a schema keyword may name (``protocol.configured``); None while unknown."""
    values: dict[str, Any] = {
        "served_models": sorted({config.model_name, config.model}),
        "max_n": config.max_n,
        "max_stop_strings": config.max_stop_strings,
        "max_token_id": None if vocab_size is None else vocab_size - 1,
    }
    for name, (low, high) in lookahead_bounds(config.lookahead).items():
        values[f"min_{name}"], values[f"max_{name}"] = low, high
    return values


def fill_settings(schema: Any, values: dict[str, Any]) -> None:
    """Replace, everywhere in ``schema``, each ``x-settings`` marker by its keywords with their values (a keyword
    whose value is unknown yet is left out).

    >>> schema = {"anyOf": [{"type": "integer", "x-settings": {"maximum": "max_n"}}, {"type": "null"}]}
    >>> fill_settings(schema, {"max_n": 8}); schema["anyOf"][0]
    {'type': 'integer', 'maximum': 8}
    """
    if isinstance(schema, dict):
        for keyword, setting in schema.pop(SETTINGS_KEY, {}).items():
            if values[setting] is not None:
                schema[keyword] = values[setting]
        items = schema.values()
    elif isinstance(schema, list):
        items = schema
    else:
        return
    for item in items:
        fill_settings(item, values)


def route_models(app: FastAPI) -> list[tuple[type[BaseModel], JsonSchemaMode]]:
    """The models the documented routes take (request bodies, validated) and answer with (``response_model`` and
    the models of their ``responses=``, serialized), as FastAPI finds them, each once."""
    fields = get_fields_from_routes(app.routes)
    models = [(field.field_info.annotation, field.mode) for field in fields]
    return list(dict.fromkeys((model, mode) for model, mode in models
                              if isinstance(model, type) and issubclass(model, BaseModel)))


def openapi_document(app: FastAPI, config: ServerConfig, vocab_size: int | None = None) -> dict[str, Any]:
    """FastAPI's document for ``app`` with this server's settings (module contract)."""
    document = get_openapi(title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes)
    components = document.setdefault("components", {})
    _, bundle = models_json_schema(route_models(app), ref_template=REF)
    components["schemas"] = bundle["$defs"]  # without FastAPI's 422 body, never sent here
    fill_settings(components["schemas"], settings(config, vocab_size))
    for methods in document["paths"].values():
        for operation in methods.values():
            operation["responses"].pop("422", None)
            if "401" in operation["responses"]:
                operation["security"] = [{"bearer": []}]
                components["securitySchemes"] = BEARER
    return document


def install_openapi(app: FastAPI, config: ServerConfig, vocab_size: Callable[[], int | None] = lambda: None) -> None:
    """Serve ``openapi_document`` at ``/openapi.json``; cached once ``vocab_size()`` is known (the model loaded)."""

    def cached() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        vocab = vocab_size()
        document = openapi_document(app, config, vocab)
        if vocab is not None:
            app.openapi_schema = document
        return document

    app.openapi = cached  # type: ignore[method-assign]
