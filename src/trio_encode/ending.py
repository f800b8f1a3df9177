"""How a request ended, and the one place that decides what a late call gets from it.

A call can come after its request stopped serving: a sibling's ``/encode`` while the scope
releases, a pull after the encode failed, a ``/send`` retried after the 200 was lost, a part
whose sibling failed. What each gets depends only on how the request ended, seen as an
:class:`Ended`: while the scope is still ending (the scope builds it from its own state) or
after it is gone (the registry's tombstone, the same record frozen), together with the failures
the service remembers for requests that left no tombstone. :func:`late_call` and
:func:`refusal` are that decision; nothing else chooses a late call's answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trio_encode.errors import RequestError, RequestReleased, ScopeExpired, ShuttingDown
from trio_encode.request_types import EmbeddingShape, EndReason, Receiver, SendReport

Call = Literal["encode", "pull", "send"]
"""The calls that name a request: SGLang's tokenizer ``/encode``, a rank's metadata pull and
its ``/send``."""


@dataclass(frozen=True)
class Failure:
    """A request error kept as its class and message, never as the exception: a raised
    exception's traceback holds the frames (and the image bytes) that raised it, and one
    exception object raised in several waiting tasks would collect all their tracebacks."""

    error_type: type[RequestError]
    message: str

    @classmethod
    def of(cls, error: RequestError) -> Failure:
        return cls(type(error), error.message)

    def error(self, req_id: str) -> RequestError:
        """A fresh exception for one caller."""
        return self.error_type(self.message, req_id=req_id)


@dataclass(frozen=True)
class Ended:
    """A request that no longer serves calls: why, and what it had done.

    Never holds an exception, a frame or an embedding (a tombstone outlives the request by an
    hour)."""

    reason: EndReason | None
    """None while the scope ends without a reason yet (a shutdown that is under way)."""
    failure: Failure | None
    shape: EmbeddingShape | None
    done: frozenset[Receiver]
    """Receivers whose bytes landed (at most ``receive_count`` of them)."""
    receive_count: int | None
    gone: bool = False
    """The scope has released everything and only this record is left (a tombstone)."""


def refusal(req_id: str, ended: Ended) -> RequestError:
    """The error for any call the request can no longer serve: its own failure if it failed,
    else why it stopped (410 released or complete, 504 expired, 503 shutting down)."""
    if ended.failure is not None:
        return ended.failure.error(req_id)
    reason = ended.reason
    if ended.gone:
        return RequestReleased(
            f"this req_id's scope has already been released ({reason})", req_id=req_id
        )
    if reason == "expired":
        expected = "an unknown number of" if ended.receive_count is None else ended.receive_count
        return ScopeExpired(
            f"the request's send_timeout expired with {len(ended.done)} of "
            f"{expected} receivers done",
            req_id=req_id,
        )
    if reason == "completed":
        return RequestReleased(
            "the request is complete: all receivers have been sent to", req_id=req_id
        )
    if reason == "shutdown" or reason is None:
        return ShuttingDown(req_id=req_id)
    return RequestReleased(f"the request has ended ({reason})", req_id=req_id)


def late_call(
    call: Call,
    req_id: str,
    ended: Ended | None,
    *,
    failure: Failure | None = None,
    family_failure: Failure | None = None,
    receiver: Receiver | None = None,
    closed: bool = False,
) -> SendReport | None:
    """The answer for ``call`` on ``req_id`` when no live scope serves it; None when the call
    goes on as for a request never seen (an ``/encode`` opens a scope, a pull waits for one, a
    ``/send`` gets 404). Raises the error the call gets otherwise.

    ``ended``: the request's tombstone. ``failure``: its failure remembered where it left no
    tombstone (bad input); a corrected ``/encode`` may reuse the id, so only pulls and sends
    get it. ``family_failure``: the failure of a sibling part, which ends every part.
    ``receiver``: a ``/send``'s; one already served gets its answer again (its first 200 was
    lost), marked as a repeat. ``closed``: the server is shutting down, so a call that would
    need a new scope (or wait for one) gets 503.
    """
    if ended is not None:
        if receiver is not None:
            again = SendReport.again(receiver, ended.shape, ended.done, ended.receive_count)
            if again is not None:
                return again
        raise refusal(req_id, ended)
    if closed:
        raise ShuttingDown(req_id=req_id)
    if failure is not None and call != "encode":
        raise failure.error(req_id)
    if family_failure is not None:
        raise family_failure.error(req_id)
    return None
