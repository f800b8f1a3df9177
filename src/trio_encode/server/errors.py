"""The one place where failures become HTTP answers of the contract's error shape.

``{"status": "error", "error": kind, "message": ..., "req_id": ...}`` for every 4xx and 5xx,
whatever raised it: a service error, an engine error (which adds ``engine_call``,
``engine_code`` and ``engine_meaning``), Quart itself (404 route, 405, 408, 413, 415, 431), or
a bug. A bug is answered with a generic 500 and logged with its traceback here, never sent to
the client.
A 503 carries ``Retry-After``; a 401 carries ``WWW-Authenticate: Bearer``.
"""

from __future__ import annotations

import logging
from typing import Any

from quart import Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from trio_encode.engine import EngineError
from trio_encode.errors import (
    EngineFailed,
    HeadersTooLarge,
    InternalError,
    InvalidInput,
    MethodNotAllowed,
    NoSuchRoute,
    RequestError,
    RequestTimedOut,
    TooLarge,
    Unauthorized,
    UnsupportedMediaType,
)
from trio_encode.sizes import format_size

log = logging.getLogger(__name__)

# Failures Quart detects before a handler runs, with the message each answer carries.
_HTTP_ERRORS: dict[int, tuple[type[RequestError], str]] = {
    400: (InvalidInput, "the request cannot be read"),
    401: (Unauthorized, "missing or wrong bearer token (Authorization: Bearer ...)"),
    404: (NoSuchRoute, "no such route"),
    405: (MethodNotAllowed, "method not allowed on this route"),
    408: (RequestTimedOut, "the request did not arrive in time"),
    413: (TooLarge, "the request body is larger than this server accepts"),
    415: (UnsupportedMediaType, "the body's media type is not one this route reads"),
    431: (HeadersTooLarge, "the request's headers are larger than this server accepts"),
}


def error_response(error: RequestError) -> Response:
    """The contract's answer for ``error``: its status, kind, message and headers."""
    body: dict[str, Any] = {
        "status": "error",
        "error": error.kind,
        "message": error.message,
        "req_id": error.req_id,
    }
    if isinstance(error, EngineFailed):
        body["engine_call"] = error.engine_call
        body["engine_code"] = error.engine_code
        body["engine_meaning"] = error.engine_meaning
    response: Response = jsonify(body)
    response.status_code = error.status
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(error.retry_after)
    if error.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


def unauthorized() -> Response:
    """The answer to a protected route called without the right token."""
    return error_response(Unauthorized(_HTTP_ERRORS[401][1]))


def install_error_handlers(app: Any) -> None:
    """Register the handlers that turn every exception into a contract error answer."""

    async def request_error(exc: RequestError) -> Response:
        if exc.req_id is None:
            exc.req_id = _current_req_id()
        else:  # found in a body that failed to parse: the access log names it too
            g.req_id = exc.req_id
        if exc.status >= 500:
            log.warning(
                "%d %s: %s", exc.status, exc.kind, exc.message, extra={"req_id": exc.req_id}
            )
        return error_response(exc)

    async def engine_error(exc: EngineError) -> Response:
        # The scope already logged and counted it.
        return error_response(EngineFailed.from_engine_error(exc, req_id=_current_req_id()))

    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        cls, message = _HTTP_ERRORS.get(status, (InternalError, exc.name))
        if status == 413:
            message += _body_limit()
        error = cls(message)
        error.status = status  # Quart's own status, also for one this table does not name
        return error_response(error)

    async def unexpected(exc: Exception) -> Response:
        req_id = _current_req_id()
        log.error("unexpected error", exc_info=exc, extra={"req_id": req_id})
        return error_response(
            InternalError("internal server error (logged on the server)", req_id=req_id)
        )

    # Quart picks the most specific class, so the catch-all only sees what nothing else maps.
    app.register_error_handler(RequestError, request_error)
    app.register_error_handler(EngineError, engine_error)
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(Exception, unexpected)


def _body_limit() -> str:
    """``: at most N bytes`` for the body being refused (the route's own limit, else the
    server's ``max_body_bytes``: Quart's public per-request ``max_content_length``)."""
    limit = request.max_content_length
    return f": at most {limit} bytes ({format_size(limit)})" if limit else ""


def _current_req_id() -> str | None:
    """The ``req_id`` of the body being served, when it was parsed far enough to have one."""
    req_id = getattr(g, "req_id", None)
    return req_id if isinstance(req_id, str) else None
