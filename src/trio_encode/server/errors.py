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


def error_answer(error: RequestError) -> tuple[int, dict[str, Any], list[tuple[str, str]]]:
    """The contract's answer for ``error``: its status, body and headers (on either path)."""
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
    headers = []
    if error.retry_after is not None:
        headers.append(("Retry-After", str(error.retry_after)))
    if error.status == 401:
        headers.append(("WWW-Authenticate", "Bearer"))
    return error.status, body, headers


def error_response(error: RequestError) -> Response:
    """The contract's answer for ``error`` as Quart's response."""
    status, body, headers = error_answer(error)
    response: Response = jsonify(body)
    response.status_code = status
    for name, value in headers:
        response.headers[name] = value
    return response


def unauthorized() -> RequestError:
    """The failure of a protected route called without the right token."""
    return Unauthorized(_HTTP_ERRORS[401][1])


def http_failure(status: int, detail: str = "", *, name: str = "") -> RequestError:
    """The failure for a status the HTTP layer itself detected (``detail`` ends its message;
    ``name``: the message of a status the table does not name)."""
    cls, message = _HTTP_ERRORS.get(status, (InternalError, name))
    error = cls(message + detail)
    error.status = status  # the layer's own status, also for one this table does not name
    return error


def failure_of(exc: Exception, call: Any) -> RequestError:
    """What ``exc``, raised while serving the request whose facts ``call`` holds (its
    ``req_id``), is answered with; logged here when it is the server's fault."""
    if isinstance(exc, RequestError):
        if exc.req_id is None:
            exc.req_id = _req_id_of(call)
        else:  # found in a body that failed to parse: the access log names it too
            call.req_id = exc.req_id
        if exc.status >= 500:
            log.warning(
                "%d %s: %s", exc.status, exc.kind, exc.message, extra={"req_id": exc.req_id}
            )
        return exc
    if isinstance(exc, EngineError):  # the scope already logged and counted it
        return EngineFailed.from_engine_error(exc, req_id=_req_id_of(call))
    req_id = _req_id_of(call)
    log.error("unexpected error", exc_info=exc, extra={"req_id": req_id})
    return InternalError("internal server error (logged on the server)", req_id=req_id)


def install_error_handlers(app: Any) -> None:
    """Register the handlers that turn every exception into a contract error answer."""

    async def request_error(exc: Exception) -> Response:
        return error_response(failure_of(exc, g))

    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        detail = _body_limit() if status == 413 else ""
        return error_response(http_failure(status, detail, name=exc.name))

    # Quart picks the most specific class, so the catch-all only sees what nothing else maps.
    app.register_error_handler(RequestError, request_error)
    app.register_error_handler(EngineError, request_error)
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(Exception, request_error)


def _body_limit() -> str:
    """``: at most N bytes`` for the body being refused: the server's ``max_body_bytes``
    (Quart's ``max_content_length``; control routes are refused before Quart reads)."""
    limit = request.max_content_length
    return f": at most {limit} bytes ({format_size(limit)})" if limit else ""


def _req_id_of(call: Any) -> str | None:
    """The ``req_id`` of the body being served, when it was parsed far enough to have one."""
    req_id = getattr(call, "req_id", None)
    return req_id if isinstance(req_id, str) else None
