"""Request bodies: bytes in, a JSON value out, or a 400 that says why.

Contract: ``decode_json(body)`` accepts exactly UTF-8 JSON (a leading UTF-8 byte-order mark is ignored, as RFC 8259
allows) and raises ``BadRequestError`` for anything else: bytes that are not UTF-8 (UTF-16 included), invalid JSON,
the non-standard constants ``NaN``, ``Infinity`` and ``-Infinity``, nesting deeper than the parser can follow, and
strings holding a lone surrogate (``"\\ud800"`` is valid JSON syntax but no Unicode text; the tokenizer cannot
encode it). It never raises anything else, so a hostile body can only ever cost a 400. ``parse_body(model, data,
field_names)`` validates a decoded body against a protocol model: 400 naming the first bad field.

``json_body_route(authorize, limit)`` is the route class of the routes whose handler takes a typed body (a
protocol model parameter, which FastAPI validates and documents): before FastAPI reads the body, the request is
authorized, then its body read within ``limit(request)`` bytes (``read_body``: 413 beyond; a 400 for anything
``decode_json`` refuses and for a body that is no JSON object), whatever its content type; FastAPI then
validates the decoded object, and its ``RequestValidationError`` reaches the one handler that turns it into
OpenAI's 400 (``server.errors``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection
from typing import Any, NoReturn, TypeVar

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from server.errors import BadRequestError, PayloadTooLargeError, from_validation_errors

Parsed = TypeVar("Parsed", bound=BaseModel)

PARSE_PREFIX = "We could not parse the JSON body of your request"


def decode_json(body: bytes) -> Any:
    """Parse a request body (see the module docstring for what is refused)."""
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"{PARSE_PREFIX}: the body is not UTF-8 ({exc.reason} at byte {exc.start}).") from exc
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise BadRequestError(f"{PARSE_PREFIX}: it is nested too deeply.") from exc
    except ValueError as exc:
        raise BadRequestError(f"{PARSE_PREFIX}: {exc}") from exc
    where = lone_surrogate_path(data)
    if where is not None:
        where = printable(where)  # the path may hold the surrogate itself (a key): never echo it raw
        raise BadRequestError(
            f"The request body holds a lone UTF-16 surrogate in {where or 'the body'}: strings must be valid Unicode.",
            param=where or None,
        )
    return data


def printable(text: str) -> str:
    """``text`` with lone surrogates written as escapes (``\\ud800``), so that it can be encoded as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a valid JSON number")


def lone_surrogate_path(data: Any) -> str | None:
    """The path of a string (value or key) holding a lone surrogate, ``None`` when there is none.

    Iterative, so it follows any depth the JSON parser produced. ``""`` is the top-level value itself.

    >>> lone_surrogate_path({"messages": [{"content": "ok"}, {"content": "\\ud800"}]})
    'messages[1].content'
    >>> lone_surrogate_path({"stop": ["\\U0001F600"]}) is None
    True
    """
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                if _has_surrogate(key):
                    return child
                pending.append((child, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{index}]", item) for index, item in enumerate(value))
    return None


def _has_surrogate(text: str) -> bool:
    """True if ``text`` cannot be encoded as UTF-8 (only lone surrogates make a Python str unencodable)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_body(model: type[Parsed], data: Any, field_names: Collection[str]) -> Parsed:
    """Validate ``data`` (a decoded body) against a protocol model; 400 naming the first bad field
    (``from_validation_errors`` over the endpoint's ``field_names``)."""
    if not isinstance(data, dict):
        raise BadRequestError("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(), field_names) from exc


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes; 413 beyond ``limit`` bytes (the declared length is checked before reading)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"The request body exceeds {limit} bytes.")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > limit:
            raise PayloadTooLargeError(f"The request body exceeds {limit} bytes.")
    return bytes(body)


JSON_HEADER = (b"content-type", b"application/json")


def json_body_route(
    authorize: Callable[[Request], Awaitable[None]], limit: Callable[[Request], int]
) -> type[APIRoute]:
    """The route class of typed-body routes (module contract); routes without a body are left as FastAPI's."""

    class JSONBodyRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handler = super().get_route_handler()
            if self.body_field is None:
                return handler

            async def read_then_handle(request: Request) -> Response:
                await authorize(request)
                raw = await read_body(request, limit(request))
                data = decode_json(raw)
                if not isinstance(data, dict):
                    raise BadRequestError("The request body must be a JSON object.")
                headers = [(key, value) for key, value in request.scope["headers"] if key != b"content-type"]
                decoded = Request({**request.scope, "headers": [*headers, JSON_HEADER]}, request.receive)
                decoded._body, decoded._json = raw, data  # what FastAPI reads: the body, decoded once
                return await handler(decoded)

            return read_then_handle

    return JSONBodyRoute
