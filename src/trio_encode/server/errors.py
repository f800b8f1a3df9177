"""The one place where failures become HTTP answers of the contract's error shape.

``{"status": "error", "message": ..., "req_id": ...}`` for every 4xx and 5xx, whatever raised
it: a service error, an engine error, Quart itself (404 route, 405, 413), or a bug. A bug is
answered with a generic 500 and logged with its traceback here, never sent to the client.
"""

from __future__ import annotations

import logging
from typing import Any

from quart import Response, g, jsonify
from werkzeug.exceptions import HTTPException

from trio_encode.engine import EngineError
from trio_encode.errors import RequestError

log = logging.getLogger(__name__)

_HTTP_MESSAGES = {
    401: "missing or wrong bearer token",
    404: "no such route",
    405: "method not allowed on this route",
    413: "the request body is larger than this server accepts",
}


def error_response(status: int, message: str, req_id: str | None = None) -> Response:
    response: Response = jsonify({"status": "error", "message": message, "req_id": req_id})
    response.status_code = status
    return response


def install_error_handlers(app: Any) -> None:
    """Register the handlers that turn every exception into a contract error answer."""

    async def request_error(exc: RequestError) -> Response:
        status = exc.status
        req_id = exc.req_id or _current_req_id()
        if status >= 500:
            log.warning("%d: %s", status, exc.message, extra={"req_id": req_id})
        return error_response(status, exc.message, req_id)

    async def engine_error(exc: EngineError) -> Response:
        # The scope already logged and counted it; the message names the engine's code.
        return error_response(502, str(exc), _current_req_id())

    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        return error_response(status, _HTTP_MESSAGES.get(status, exc.name), None)

    async def unexpected(exc: Exception) -> Response:
        log.error("unexpected error", exc_info=exc, extra={"req_id": _current_req_id()})
        return error_response(
            500, "internal server error (logged on the server)", _current_req_id()
        )

    # Quart picks the most specific class, so the catch-all only sees what nothing else maps.
    app.register_error_handler(RequestError, request_error)
    app.register_error_handler(EngineError, engine_error)
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(Exception, unexpected)


def _current_req_id() -> str | None:
    """The ``req_id`` of the body being served, when it was parsed far enough to have one."""
    req_id = getattr(g, "req_id", None)
    return req_id if isinstance(req_id, str) else None
