"""The request-level failures the service reports, each carrying the facts behind it.

Each names the contract's HTTP status for it (``status``): the server answers with it
(``server/errors.py``) and the client maps statuses back to these classes, from one table.
Transfer-engine failures are :class:`trio_encode.engine.EngineError`.
"""

from __future__ import annotations


class RequestError(Exception):
    """Base class: a request could not be served, for a reason a client can act on."""

    status: int = 500
    """The HTTP status of the contract for this failure (server and client both read it)."""

    def __init__(self, message: str, *, req_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.req_id = req_id


class InvalidInput(RequestError):
    """The request body or one of its images is unusable (400)."""

    status = 400


class UnknownRequest(RequestError):
    """A ``/send`` for a ``req_id`` that no ``/encode`` named here (404)."""

    status = 404


class RequestReleased(RequestError):
    """The request's scope has already ended; a late call cannot resurrect it (410)."""

    status = 410


class ReceiveCountConflict(RequestError):
    """Two calls for one ``req_id`` disagree on ``receive_count`` (409)."""

    status = 409


class EncodeFailed(RequestError):
    """The encoder failed for this request; every sibling gets the same error (500)."""

    status = 500


class ScopeExpired(RequestError):
    """The request's backstop deadline fired while this call waited (504)."""

    status = 504


class ShuttingDown(RequestError):
    """The server is stopping and cut the request short (503)."""

    status = 503


class Overloaded(RequestError):
    """The encoder queue is full, or the server is not ready (503)."""

    status = 503


class InternalError(RequestError):
    """A bug inside the server ended this request (and only it); the traceback is logged (500)."""

    status = 500


class EncodeNotArrived(RequestError):
    """A metadata pull waited its whole bound and no ``/encode`` named the ``req_id`` (504)."""

    status = 504
