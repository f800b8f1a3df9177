"""A request's state: one record, its transitions in one table, and the one function that
decides what a call gets once the request no longer serves it.

A request moves ``encoding -> encoded -> ending -> gone`` (or straight from ``encoding`` to
``ending`` when its encode fails); :data:`TRANSITIONS` is every move there is, and
:class:`RequestState` is the only thing that makes one. Its end is written once: the first
reason and the first failure stand, whatever comes after (a shutdown after a failure, the
deadline after completion). What a request leaves behind when it is gone, its tombstone, is the
same record frozen (:class:`Ended`).

A call can come after its request stopped serving: a sibling's ``/encode`` while the scope
releases, a pull after the encode failed, a ``/send`` retried after its 200 was lost, a part
whose sibling failed, a ``/send`` for an id never seen. :func:`answer` decides what each gets,
from the :class:`Ended` record alone (built from the live state while the scope ends, or the
tombstone after); nothing else chooses a late call's answer.

Knows nothing of Trio, HTTP or the engine: the scope drives it, the registry keeps its tombstone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trio_encode.errors import (
    ReceiveCountConflict,
    RequestError,
    RequestReleased,
    ScopeExpired,
    ShuttingDown,
    UnknownRequest,
)
from trio_encode.request_types import EmbeddingShape, EndReason, Receiver, SendReport

Call = Literal["encode", "pull", "send"]
"""The calls that name a request: SGLang's tokenizer ``/encode``, a rank's metadata pull and
its ``/send``."""

Phase = Literal["encoding", "encoded", "ending", "gone"]
"""``encoding``: the one encoder run is under way; ``encoded``: the shape is published and
sends are served; ``ending``: it has a reason to end and is releasing what it holds;
``gone``: released, only its tombstone is left."""

Event = Literal["encoded", "end", "release"]

TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    ("encoding", "encoded"): "encoded",
    ("encoding", "end"): "ending",
    ("encoded", "end"): "ending",
    ("ending", "encoded"): "ending",  # an encode that returns after the end publishes nothing
    ("ending", "end"): "ending",  # a later end changes nothing: see RequestState.end
    ("ending", "release"): "gone",
}
"""Every move a request's state can make; any other is a bug (:class:`IllegalMove`)."""

RETRIABLE: frozenset[EndReason] = frozenset({"invalid_input", "refused"})
"""Ends whose ``req_id`` a corrected ``/encode`` may reuse at once (bad input, a transient
503): their tombstone answers pulls and sends with the failure, but not a new ``/encode``."""

DEFAULT_RECEIVE_COUNT = 1
"""The count a send fixes when none is known yet and it names none itself."""


class IllegalMove(RuntimeError):
    """A move :data:`TRANSITIONS` does not have."""


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


@dataclass(eq=False)
class RequestState:
    """One request's state; every change to it is a method here."""

    req_id: str
    deadline: float
    receive_count: int | None
    """How many distinct receivers end the request; ``None`` until a call names it."""
    phase: Phase = "encoding"
    shape: EmbeddingShape | None = None
    reason: EndReason | None = None
    failure: Failure | None = None
    done: set[Receiver] = field(default_factory=set)
    """Receivers whose bytes have landed."""

    def _move(self, event: Event) -> None:
        phase = TRANSITIONS.get((self.phase, event))
        if phase is None:
            raise IllegalMove(f"{self.req_id}: {event!r} in phase {self.phase!r}")
        self.phase = phase

    def encoded(self, shape: EmbeddingShape) -> None:
        """The encode ran: ``shape`` is published, unless the request already ends."""
        serving = self.phase == "encoding"
        self._move("encoded")
        if serving:
            self.shape = shape

    def end(self, reason: EndReason, failure: Failure | None = None) -> EndReason:
        """Start ending. The first reason and the first failure stand: what comes after
        never rewrites why a request ended. Returns the reason that stands."""
        self._move("end")
        if self.failure is None:
            self.failure = failure
        if self.reason is None:
            self.reason = reason
        return self.reason

    def release(self) -> Ended:
        """Everything is released: the tombstone."""
        self._move("release")
        return self.ended(gone=True)

    @property
    def serving(self) -> bool:
        """Whether calls may still join (false from the moment it starts ending)."""
        return self.phase in ("encoding", "encoded")

    def name_count(self, receive_count: int | None) -> None:
        """Siblings must agree on how many receivers there are (409 otherwise).

        A request opened without a count takes the first one a call names. No receiver can be
        done before that: a send fixes the count before its transfer starts."""
        if receive_count is None:
            return
        if self.receive_count is None:
            self.receive_count = receive_count
        elif receive_count != self.receive_count:
            raise ReceiveCountConflict(
                f"receive_count {receive_count} conflicts with {self.receive_count} given "
                "by an earlier call for this req_id",
                req_id=self.req_id,
            )

    def receiver_done(self, receiver: Receiver) -> bool:
        """Count ``receiver``'s bytes as landed; True when that completes the request."""
        self.done.add(receiver)
        return self.receive_count is not None and len(self.done) >= self.receive_count

    def ended(self, *, now: float | None = None, gone: bool = False) -> Ended:
        """How the request ended (or is ending) as its tombstone keeps it. Past its deadline
        with no reason yet (the backstop is firing), it ended by expiring."""
        reason = self.reason
        if reason is None and now is not None and now >= self.deadline:
            reason = "expired"
        return Ended(
            reason, self.failure, self.shape, frozenset(self.done), self.receive_count, gone
        )


def repeat(receiver: Receiver, ended: Ended | RequestState) -> SendReport | None:
    """The answer for a ``receiver`` already sent to, marked as a repeat (its first 200 was
    lost; no bytes move again); None when it was not sent to."""
    if ended.shape is None or receiver not in ended.done:
        return None
    assert ended.receive_count is not None  # fixed before the first transfer
    return SendReport(ended.shape, len(ended.done), ended.receive_count, repeat=True)


def answer(
    call: Call,
    req_id: str,
    ended: Ended | None,
    *,
    receiver: Receiver | None = None,
    family_failure: Failure | None = None,
    closed: bool = False,
) -> SendReport | None:
    """What ``call`` on ``req_id`` gets when no serving request takes it: raises its error,
    returns a served receiver's answer again, or None when the call goes on (an ``/encode``
    opens a request, a pull waits for one).

    ``ended``: the request as it ends, or its tombstone. ``receiver``: a ``/send``'s; one
    already served gets its answer again, marked as a repeat. ``family_failure``: the failure
    of a sibling part, which ends every part. ``closed``: the server is shutting down, so a
    call that would need a new request (or wait for one) gets 503; a ``/send`` still learns
    why its request is gone, or that it was never seen here (404).
    """
    if ended is not None and not (ended.gone and ended.reason in RETRIABLE):
        again = None if receiver is None else repeat(receiver, ended)
        if again is not None:
            return again
        raise refusal(req_id, ended)
    if closed and call != "send":
        raise ShuttingDown(req_id=req_id)
    if ended is not None and call != "encode":
        raise refusal(req_id, ended)  # a bad input's failure, for its late pulls and sends
    if family_failure is not None:
        raise family_failure.error(req_id)
    if call == "send":
        raise UnknownRequest(
            "no /encode has named this req_id here (or it ended too long ago to remember)",
            req_id=req_id,
        )
    return None


def refusal(req_id: str, ended: Ended) -> RequestError:
    """The error for any call ``ended`` can no longer serve (the part of :func:`answer` a
    caller needing the error itself uses): its own failure if the request failed, else why it
    stopped (410 released or complete, 504 expired, 503 shutting down)."""
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
