"""The one place that maps exceptions to HTTP statuses and OpenAI's error envelope.

Contract: every error response the server sends has the body ``ErrorResponse``,
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``. ``APIError`` and its
subclasses carry status, type, param and code; ``to_api_error`` turns anything else (decoding errors, pydantic
and FastAPI validation errors, Starlette HTTP errors, unexpected exceptions) into one. FastAPI's 422 never
leaves the server: a validation failure is a 400. A route declares the statuses it answers with
``error_responses`` (its ``responses=``: the envelope, and ``Retry-After`` where the error sends it), from which
the OpenAPI document takes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decoding.errors import ContextLengthError, InvalidParameterError

logger = logging.getLogger("server.errors")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every 4xx and 5xx body."""

    error: ErrorDetail


class APIError(Exception):
    """An error with an HTTP status and the fields of OpenAI's envelope."""

    status = 500
    type = "server_error"
    code: str | None = None
    headers: dict[str, str] | None = None
    reject_reason: str | None = None  # set: the request was refused before decoding (counted in metrics)

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI envelope (``ErrorResponse``)."""
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()


class BadRequestError(APIError):
    status = 400
    type = "invalid_request_error"
    reject_reason = "invalid_request"


class AuthenticationError(APIError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    reject_reason = "unauthorized"


class NotFoundError(APIError):
    status = 404
    type = "invalid_request_error"


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"
    reject_reason = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.", param="model")


class PayloadTooLargeError(APIError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    reject_reason = "invalid_request"


class QueueFullError(APIError):
    """Admission refused: the waiting queue is full. Sent with ``Retry-After``."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    reject_reason = "queue_full"

    def __init__(self, message: str, retry_after_seconds: int = 1) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after_seconds)}


class ServiceUnavailableError(APIError):
    """Not ready yet (loading, warming up) or draining for shutdown."""

    status = 503
    type = "server_error"
    code = "service_unavailable"

    def __init__(self, message: str, reason: str | None = None, retry_after_seconds: int = 1) -> None:
        super().__init__(message)
        self.reject_reason = reason
        self.headers = {"Retry-After": str(retry_after_seconds)}


class InternalError(APIError):
    status = 500
    type = "server_error"
    code = "internal_error"


ERROR_DESCRIPTIONS = {
    400: "Invalid request: bad JSON, wrong types, out-of-range values, context length exceeded.",
    401: "Missing or wrong API key (when the server has keys).",
    404: "Unknown model, or (/v1/responses) an unknown stored response.",
    413: "Request body over the configured limit.",
    429: "Queue full; retry after Retry-After seconds.",
    500: "The generation failed (this request only).",
    503: "Loading, warming up or draining; retry after Retry-After seconds.",
}
RETRY_AFTER_STATUSES = (QueueFullError.status, ServiceUnavailableError.status)  # the errors that send Retry-After


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=`` for the error statuses it answers: each the envelope, with ``Retry-After`` where
    the server sends it.

    >>> error_responses(429)[429]["headers"]["Retry-After"]["description"]
    'seconds'
    """
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        responses[status] = {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
        if status in RETRY_AFTER_STATUSES:
            responses[status]["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
    return responses


def validation_param(loc: Sequence[Any], field_names: Iterable[str] = ()) -> str | None:
    """Render a pydantic error location as a param path, skipping union-member tags.

    >>> validation_param(("body", "messages", 0, "content", "str"), {"messages", "content"})
    'messages[0].content'
    """
    names = set(field_names)
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item != "body" and (not names or item in names):
            parts.append(f".{item}" if parts else item)
    return "".join(parts) or None


def from_validation_errors(errors: Sequence[dict[str, Any]], field_names: Iterable[str] = ()) -> BadRequestError:
    """A 400 naming the first failing field (pydantic or FastAPI validation errors)."""
    if not errors:
        return BadRequestError("invalid request")
    first = _most_specific(errors)
    loc = tuple(first.get("loc", ()))
    param = validation_param(loc, field_names)
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = "field required"
    if first.get("type") == "extra_forbidden" and loc:  # an unknown field: name it, though no model defines it
        parent = validation_param(loc[:-1], field_names)
        param = f"{parent}.{loc[-1]}" if parent else str(loc[-1])
        message = "unknown field"
    if param:
        message = f"{param}: {message}"
    return BadRequestError(message, param=param)


def _most_specific(errors: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Among the errors of the first failing field, the deepest one (for a union such as ``str | list[Part]``,
    the branch that got furthest names the real problem)."""
    field = tuple(errors[0].get("loc", ()))[:1]
    same_field = [error for error in errors if tuple(error.get("loc", ()))[:1] == field]
    return max(same_field, key=lambda error: len(error.get("loc", ())))


def to_api_error(exc: BaseException, field_names: Iterable[str] = ()) -> APIError:
    """Map any exception to an ``APIError`` (unknown exceptions become a 500 that hides internals)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return BadRequestError(str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidParameterError):
        return BadRequestError(str(exc), param=exc.param)
    if isinstance(exc, ValidationError):
        return from_validation_errors(exc.errors(), field_names)
    if isinstance(exc, RequestValidationError):
        return from_validation_errors(list(exc.errors()), field_names)
    if isinstance(exc, StarletteHTTPException):
        error = APIError(str(exc.detail))
        error.status = exc.status_code
        error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error.headers = dict(exc.headers) if exc.headers else None  # e.g. 405's Allow
        return error
    return InternalError("The server had an error while processing your request.")


def error_response(error: APIError) -> JSONResponse:
    """The JSON response for ``error``."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class InternalErrorMiddleware:
    """Turn an exception no handler took into the 500 envelope, logged once, on a connection that stays usable.

    (Starlette's own ``Exception`` handler answers and then re-raises, so uvicorn logs the error a second time and
    closes the connection under a keep-alive client.) Once a response has started, nothing can be sent any more:
    the exception is re-raised for the server to close the connection.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            error = to_api_error(exc)
            if isinstance(error, InternalError):
                logger.error("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            if started:
                raise
            await error_response(error)(scope, receive, send)


def install_error_handlers(
    app: FastAPI, field_names: Iterable[str] = (), on_reject: Callable[[str], None] | None = None
) -> None:
    """Route every exception the app can raise through ``to_api_error``; report refusals to ``on_reject``.

    Typed errors go through exception handlers; anything else reaches ``InternalErrorMiddleware``.
    """
    names = frozenset(field_names)

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        error = to_api_error(exc, names)
        if error.reject_reason is not None and on_reject is not None:
            on_reject(error.reject_reason)
        return error_response(error)

    for exc_type in (APIError, RequestValidationError, StarletteHTTPException, InvalidParameterError):
        app.add_exception_handler(exc_type, handle)
    app.add_middleware(InternalErrorMiddleware)
