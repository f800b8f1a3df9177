"""Every request-level failure of the package, each a class that carries its own facts.

Each class names the contract's HTTP status (``status``) and a stable machine-readable
``kind``; the server answers with both (``server/errors.py``) and the client turns a kind back
into its class with :func:`error_class`, so neither side parses prose. A 503 also says when to
try again (``retry_after``). Transfer-engine failures are raised inside the package as
:class:`trio_encode.engine.EngineError` and reach clients as :class:`EngineFailed`.
"""

from __future__ import annotations

import copy
from typing import Self

from trio_encode.engine.base import EngineCall, EngineError, engine_code_meaning

MAX_MESSAGE_CHARS = 2048
"""An error's message is cut to this many characters. Messages quote what a client sent (a
host, a modality, a path); what goes back in an error body, a completion message or a log
line must cost in proportion to the server's words, not to the client's."""
QUOTED_CHARS = 80
"""A client's string quoted in a message shows at most this many characters."""


def clip(value: str) -> str:
    """``repr(value)`` for quoting a client's string in a message, cut to
    :data:`QUOTED_CHARS` characters (and saying how long it was)."""
    if len(value) <= QUOTED_CHARS:
        return repr(value)
    return f"{value[:QUOTED_CHARS]!r}... ({len(value)} chars)"


class RequestError(Exception):
    """Base class: a request could not be served, for a reason a client can act on."""

    status: int = 500
    """The HTTP status of the contract for this failure (server and client both read it)."""
    kind: str = "internal"
    """Stable machine-readable name of this failure, sent as ``"error"`` in every error body."""
    retry_after: int | None = None
    """Seconds after which a retry may succeed (sent as ``Retry-After``); None: do not retry."""

    def __init__(self, message: str, *, req_id: str | None = None) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            cut = len(message) - MAX_MESSAGE_CHARS
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({cut} more chars cut)"
        super().__init__(message)
        self.message = message
        self.req_id = req_id

    def fresh(self) -> Self:
        """The same error (class, message and facts) as a new exception, with no traceback
        and nothing chained: one for each caller to raise. Raising one object in several
        tasks collects all their tracebacks on it, and the frames of the first raise (an
        ``/encode`` with its images) stay alive as long as any of them keeps it."""
        return copy.copy(self)


class InternalError(RequestError):
    """A bug on the server; the details are in its log, never in the answer (500)."""

    status = 500
    kind = "internal"


class InvalidInput(RequestError):
    """The request body or one of its images is unusable (400)."""

    status = 400
    kind = "invalid_input"


class MediaTooLarge(InvalidInput):
    """A video or audio clip is over one of the server's media limits (its duration, frame
    count, pixels, decoded bytes or decode time), by its header or by what decoding it turned
    out to cost; the message names the limit's setting (413). Bad input like any other: the
    request leaves nothing behind, and a corrected ``/encode`` of the same ``req_id`` is
    served."""

    status = 413
    kind = "media_too_large"


class RequestRejected(RequestError):
    """The request was refused before its body was looked at (401, 404 route, 405, 408, 413,
    415, 431)."""


class Unauthorized(RequestRejected):
    """A protected route was called without the right bearer token (401)."""

    status = 401
    kind = "unauthorized"


class NoSuchRoute(RequestRejected):
    """No route of the contract has this path (404)."""

    status = 404
    kind = "no_route"


class MethodNotAllowed(RequestRejected):
    """The route exists but not with this method (405)."""

    status = 405
    kind = "method_not_allowed"


class TooLarge(RequestRejected):
    """The request body is larger than the server accepts (413)."""

    status = 413
    kind = "too_large"


class RequestTimedOut(RequestRejected):
    """The request (its body) did not arrive within the server's read timeout (408)."""

    status = 408
    kind = "request_timeout"


class UnsupportedMediaType(RequestRejected):
    """The body's media type is not one the route reads (415)."""

    status = 415
    kind = "unsupported_media_type"


class HeadersTooLarge(RequestRejected):
    """The request's header fields are larger than the server accepts (431)."""

    status = 431
    kind = "headers_too_large"


class ReceiverNotAllowed(RequestError):
    """A ``/send`` names a receiver host outside the server's ``allowed_receivers`` (403)."""

    status = 403
    kind = "receiver_not_allowed"


class ReceiverHostMismatch(RequestError):
    """A ``/send`` names a receiver on another host than the ``prefill_host`` its request's
    ``/encode`` named (403)."""

    status = 403
    kind = "receiver_host_mismatch"


class UnknownRequest(RequestError):
    """A ``/send`` for a ``req_id`` that no ``/encode`` named here (404)."""

    status = 404
    kind = "unknown_request"


class ReceiveCountConflict(RequestError):
    """Two calls for one ``req_id`` disagree on ``receive_count`` (409)."""

    status = 409
    kind = "conflict"


class RequestReleased(RequestError):
    """The request's scope has already ended; a late call cannot resurrect it (410)."""

    status = 410
    kind = "released"


class EncodeFailed(RequestError):
    """The encoder failed for this request; every sibling gets the same error (500)."""

    status = 500
    kind = "encode_failed"


class EngineFailed(RequestError):
    """The transfer engine returned an error code (502); ``engine_code`` is Mooncake's own."""

    status = 502
    kind = "engine_failed"

    def __init__(
        self,
        message: str,
        *,
        req_id: str | None = None,
        engine_code: int | None = None,
        engine_call: EngineCall | None = None,
    ) -> None:
        super().__init__(message, req_id=req_id)
        self.engine_code = engine_code
        self.engine_call = engine_call

    @classmethod
    def from_engine_error(cls, error: EngineError, *, req_id: str | None) -> EngineFailed:
        """The answer for an engine failure: its call and code, the receiver it wrote to and
        the length. Never a memory address nor this server's own session id: those are for the
        server's log (where the full error goes), not for whoever sent the request."""
        parts = [f"transfer engine {error.call} failed with code {error.code}"]
        if error.call == "transfer" and error.session_id is not None:
            parts.append(f"receiver {error.session_id}")
        if error.length is not None:
            parts.append(f"{error.length} bytes")
        message = ", ".join(parts) + " (details in the server's log)"
        return cls(message, req_id=req_id, engine_code=error.code, engine_call=error.call)

    @property
    def engine_meaning(self) -> str | None:
        """What Mooncake's code means, when there is one."""
        return None if self.engine_code is None else engine_code_meaning(self.engine_code)


class CompletionFailed(RequestError):
    """The bytes landed, but the prefill rank's completion message could not be delivered to
    the ZMQ endpoint its ``/send`` named (502): without it SGLang never completes the part."""

    status = 502
    kind = "completion_failed"


class Overloaded(RequestError):
    """The server is at a capacity limit (the encoder queue, live requests, bytes held, a
    client's sends in flight); retry shortly (503)."""

    status = 503
    kind = "overloaded"
    retry_after = 1


class NotReady(RequestError):
    """The server is still starting: the model or the engine is not up yet (503)."""

    status = 503
    kind = "not_ready"
    retry_after = 5


class ShuttingDown(RequestError):
    """The server is stopping and cut the request short, or takes no new one; retry on another
    server (503)."""

    status = 503
    kind = "shutting_down"
    retry_after = 5

    def __init__(
        self, message: str = "the server is shutting down", *, req_id: str | None = None
    ) -> None:
        super().__init__(message, req_id=req_id)


class ScopeExpired(RequestError):
    """The request's backstop deadline fired while this call waited (504)."""

    status = 504
    kind = "expired"


class EncodeNotArrived(RequestError):
    """A metadata pull waited its whole bound and no ``/encode`` named the ``req_id`` (504)."""

    status = 504
    kind = "not_arrived"


ERRORS: tuple[type[RequestError], ...] = (
    InternalError,
    InvalidInput,
    MediaTooLarge,
    Unauthorized,
    NoSuchRoute,
    MethodNotAllowed,
    TooLarge,
    RequestTimedOut,
    UnsupportedMediaType,
    HeadersTooLarge,
    ReceiverNotAllowed,
    ReceiverHostMismatch,
    UnknownRequest,
    ReceiveCountConflict,
    RequestReleased,
    EncodeFailed,
    EngineFailed,
    CompletionFailed,
    Overloaded,
    NotReady,
    ShuttingDown,
    ScopeExpired,
    EncodeNotArrived,
)
"""Every concrete error of the contract; the kinds are unique."""

_BY_KIND: dict[str, type[RequestError]] = {cls.kind: cls for cls in ERRORS}


def error_class(kind: str) -> type[RequestError] | None:
    """The class whose ``kind`` this is; None for a kind this version does not know."""
    return _BY_KIND.get(kind)
