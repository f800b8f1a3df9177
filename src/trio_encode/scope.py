"""RequestScope: one request's whole life, as one task with a nursery of its own.

Why a task: every TP rank sends the same embedding, so a request is shared state touched by
several HTTP handlers at once. SGLang's encode server let each ``/send`` register, transfer,
deregister and null the embedding on its own, and the siblings raced (-7 overlaps, sends of a
``None`` embedding, deregistration under a running transfer). Here a request is a task in the
service nursery; its transfers are tasks in *its* nursery; handlers only start them and wait.
So the scope's ``finally`` cannot run while a transfer is in flight, and it alone deregisters
and then drops the embedding.

The scope ends when ``receive_count`` distinct receivers are done (a count that may arrive after
the scope opened: SGLang's tokenizer opens it without one, its ranks' sends name it), when the
encode fails, when an unexpected error hits it, when the server shuts down, or when its
backstop deadline (``send_timeout`` after creation) cancels it. Whatever ends it ends only
it: no error leaves the scope's task. This module knows nothing of HTTP or torch: only the
engine, the ledger and the embedding's address and size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from trio_encode.engine import EngineError, TransferEngine, Write
from trio_encode.errors import EncodeFailed, InternalError, InvalidInput, RequestError
from trio_encode.held import HeldMemory
from trio_encode.ledger import Lease, PartialOverlap, RegistrationLedger
from trio_encode.observer import LifecycleObserver
from trio_encode.request_state import (
    DEFAULT_RECEIVE_COUNT,
    Ended,
    Failure,
    RequestState,
    answer,
    refusal,
    repeat,
)
from trio_encode.request_types import (
    EmbeddingMemory,
    EmbeddingShape,
    Encode,
    EndReason,
    Receiver,
    SendReport,
)

log = logging.getLogger(__name__)

E = TypeVar("E", bound=Exception)


@dataclass(eq=False)
class _Attempt:
    """One receiver's send in flight; a retry arriving meanwhile joins it."""

    receiver: Receiver
    done: trio.Event = field(default_factory=trio.Event)
    # Covers everything before the engine submits the transfer (waiting for the embedding, the
    # registration, a thread, a slot of the receiver's bound): a client that goes away then
    # withdraws its send; once submitted it completes and counts. A withdrawn attempt never
    # transfers, even if the register call it was waiting on returns normally.
    withdraw: trio.CancelScope = field(default_factory=trio.CancelScope)
    submitted: trio.Event = field(default_factory=trio.Event)
    """Set by the engine the moment it is bound to submit: from then on a client that leaves
    no longer withdraws it (it may already be writing), and only the request's end (its
    deadline, a shutdown) stops the wait for it."""
    waiters: int = 0
    succeeded: bool = False
    receivers_done: int = 0
    """Distinct receivers done when this send completed (later ones may finish first)."""
    error: RequestError | EngineError | None = None
    """Why it failed, kept without its traceback; each waiter raises its own copy."""


@dataclass(frozen=True)
class ScopeParts:
    """What every request scope of a server shares."""

    engine: TransferEngine
    """Sends the embedding to the receivers."""
    ledger: RegistrationLedger
    """Registers the embedding's memory, once however many siblings send it."""
    observer: LifecycleObserver
    """Told of the scope's life: its transfers, engine errors and end."""
    held: HeldMemory
    """The embedding memory live scopes hold (``max_held_bytes`` is checked against it)."""


class RequestScope:
    """The state and task of one ``req_id``. Created by :meth:`ScopeRegistry.open`."""

    def __init__(
        self,
        req_id: str,
        parts: ScopeParts,
        *,
        receive_count: int | None,
        deadline: float,
        encode: Encode,
    ) -> None:
        self._engine, self._ledger, self._observer = parts.engine, parts.ledger, parts.observer
        self._held = parts.held
        self.req_id = req_id
        self.deadline = deadline
        self.state = RequestState(req_id, deadline, receive_count)
        """The request's state: every change of it is a method of its own."""
        self.tombstone: Ended | None = None
        """The state frozen once everything is released."""
        self._encode: Encode | None = encode
        """Dropped once the encode ran: it holds the request's image bytes."""
        self._embedding: EmbeddingMemory | None = None
        self._held_ranges: list[tuple[int, int]] = []
        self._started = trio.Event()
        self._encoded = trio.Event()
        self._finished = trio.Event()
        self._ended = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._backstop = trio.CancelScope(deadline=deadline)
        self._leases: list[Lease] | None = None
        self._register_lock = trio.Lock()
        self._attempts: dict[Receiver, _Attempt] = {}
        self._bytes_sent = 0

    # -- what handlers call -----------------------------------------------------------------

    @property
    def receive_count(self) -> int | None:
        """How many distinct receivers end the scope; ``None`` until a call names it."""
        return self.state.receive_count

    @property
    def shape(self) -> EmbeddingShape | None:
        return self.state.shape

    @property
    def end_reason(self) -> EndReason | None:
        return self.state.reason

    @property
    def receivers_done(self) -> int:
        return len(self.state.done)

    @property
    def done_receivers(self) -> frozenset[Receiver]:
        """The receivers whose bytes have landed."""
        return frozenset(self.state.done)

    @property
    def failure(self) -> Failure | None:
        """Why the request failed (encode or internal error), remembered after it ends."""
        return self.state.failure

    @property
    def accepting(self) -> bool:
        """Whether new sends may still join (false from the moment the scope starts ending)."""
        return self._nursery is not None and self.state.serving and not self._backstop.cancel_called

    def check_receive_count(self, receive_count: int | None) -> None:
        """Siblings must agree on how many receivers there are (409 otherwise)."""
        if receive_count is not None and self.state.receive_count is None:
            log.info("receive_count set to %d", receive_count, extra={"req_id": self.req_id})
        self.state.name_count(receive_count)

    def cancel(self) -> None:
        """End the scope now (server shutdown); running transfers still finish first."""
        self._end("shutdown")
        self._backstop.cancel()

    def abandon(self, failure: Failure) -> None:
        """End the scope now: its request failed elsewhere (a sibling part), so no receiver
        will come. Calls get ``failure``; running transfers still finish first."""
        self._end("abandoned", failure)
        self._backstop.cancel()

    def ended(self) -> Ended:
        """How the request ended (or is ending), as its tombstone will keep it."""
        return self.state.ended(now=trio.current_time())

    async def wait_encoded(self) -> EmbeddingShape:
        """Wait for the one encoder run; every sibling gets the same answer or error.

        A call arriving once the scope is ending (complete and releasing, expired, shut down)
        gets the answer its tombstone will give, not the shape of a request it can no longer
        join: a 200 to an ``/encode`` whose sends can only be refused would mislead its rank.
        """
        if not self.state.serving or self._backstop.cancel_called:
            raise self._why_not_served()
        await self._encoded.wait()
        if self.state.shape is not None:
            return self.state.shape
        raise self._why_not_served()

    async def send(self, receiver: Receiver) -> SendReport:
        """Write the embedding into ``receiver`` and return once the bytes have landed.

        The transfer runs as a task in this scope's nursery, never in the caller's, so a
        caller that is cancelled cannot take a running transfer down with it. A receiver that
        is already done is answered at once, marked as a repeat (its first answer was lost).
        """
        if not self._started.is_set():  # no scheduler pass when there is nothing to wait for
            await self._started.wait()
        again = repeat(receiver, self.state)
        if again is not None:
            return again
        if not self.accepting:
            answer("send", self.req_id, self.ended(), receiver=receiver)  # raises its refusal
        assert self._nursery is not None
        if self.state.receive_count is None:
            # A send that names no count, to a scope that knows none, means one receiver.
            self.check_receive_count(DEFAULT_RECEIVE_COUNT)
        attempt = self._attempts.get(receiver)
        if attempt is not None and attempt.withdraw.cancel_called:
            # Withdrawn, but its engine call has not come back yet: it may have been submitted
            # just before. Wait for it, then start afresh (or answer as a repeat).
            await attempt.done.wait()
            return await self.send(receiver)
        if attempt is None:
            attempt = _Attempt(receiver)
            self._attempts[receiver] = attempt
            self._nursery.start_soon(self._run_attempt, attempt)
        attempt.waiters += 1
        try:
            await attempt.done.wait()
        finally:
            attempt.waiters -= 1
            # Nobody waits, and the engine has not submitted it: withdraw it, it never moves
            # a byte. (Submitted, it completes and counts, or ends with the request.)
            if attempt.waiters == 0 and not (attempt.done.is_set() or attempt.submitted.is_set()):
                attempt.withdraw.cancel()
        if attempt.error is not None:
            raise attempt.error.fresh()  # each waiter its own: see RequestError.fresh
        assert self.state.shape is not None
        assert self.state.receive_count is not None
        return SendReport(self.state.shape, attempt.receivers_done, self.state.receive_count)

    async def wait_ended(self) -> None:
        """Return once the scope has released everything."""
        await self._ended.wait()

    # -- the scope's own task ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The scope's body; runs in the service nursery until the request is over.

        Never raises an :class:`Exception`: a bug inside one request ends that request (500,
        traceback logged), not the service nursery and every other request with it.
        """
        opened_at = trio.current_time()
        self._observer.scope_opened(self.req_id)
        log.info("scope opened", extra={"req_id": self.req_id})
        try:
            with self._backstop as backstop:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._run_encode)
                    self._started.set()
                    task_status.started()
                    await self._finished.wait()
                    # Done: nothing may still be waiting (a sibling's retry past the count).
                    nursery.cancel_scope.cancel()
            state = self.state
            if backstop.cancelled_caught and state.reason is None:
                state.end("expired")
                self._observer.backstop_expired(self.req_id)
                if state.receive_count is not None and 0 < len(state.done) < state.receive_count:
                    self._observer.split_expired(self.req_id, len(state.done), state.receive_count)
                log.warning(
                    "backstop deadline fired with %d of %s receivers done",
                    len(state.done),
                    state.receive_count,
                    extra={"req_id": self.req_id},
                )
        except Exception as exc:
            self._fail_unexpectedly(exc)
        finally:
            reason = self._end("shutdown")
            self._started.set()
            self._encoded.set()
            with trio.CancelScope(shield=True):
                await self._release()
            self.tombstone = self.state.release()
            seconds = trio.current_time() - opened_at
            self._observer.scope_closed(self.req_id, reason, seconds)
            log.info(
                "scope closed: %s",
                reason,
                extra={
                    "req_id": self.req_id,
                    "duration_s": round(seconds, 6),
                    "bytes_sent": self._bytes_sent,
                    "receivers": f"{len(self.state.done)}/{self.state.receive_count}",
                },
            )
            self._ended.set()

    async def _run_encode(self) -> None:
        encode, self._encode = self._encode, None
        assert encode is not None  # runs once per scope
        try:
            embedding = await encode()
            shape = EmbeddingShape(
                embedding.rows,
                embedding.dim,
                embedding.nbytes,
                embedding.dtype,
                embedding.checksum,
                tuple(embedding.grids),
                tuple(embedding.image_lens),
                embedding.media,
            )
        except RequestError as exc:
            if isinstance(exc, InvalidInput):
                self._finish("invalid_input", Failure.of(exc))
            elif exc.status == 503:
                # transient: a retry of this req_id may succeed
                self._finish("refused", Failure.of(exc))
            else:
                self._finish("encode_failed", Failure.of(exc))
        except Exception as exc:
            log.exception("encoder failed", extra={"req_id": self.req_id})
            self._finish("encode_failed", Failure(EncodeFailed, f"the encoder failed: {exc}"))
        else:
            self._embedding = embedding
            self._held_ranges = self._held.take(embedding)  # given back once released
            self.state.encoded(shape)
        finally:
            self._encoded.set()

    async def _run_attempt(self, attempt: _Attempt) -> None:
        try:
            transferred = False
            with attempt.withdraw:
                segments = await self._register_once()
                if attempt.withdraw.cancel_called:
                    return  # withdrawn during the (shielded) register call: it never happened
                started = trio.current_time()
                receiver = attempt.receiver
                # Withdrawable until the engine submits it: a cancelled call submits nothing.
                write = Write(receiver.session_id, segments, receiver.buffer_address)
                await self._engine.transfer(write, submitted=attempt.submitted)
                transferred = True
            if not transferred:
                return  # withdrawn while it waited for a thread or a slot: it never happened
            attempt.succeeded = True
            self._bytes_sent += write.nbytes
            self._observer.transfer_finished(
                self.req_id, write.nbytes, trio.current_time() - started
            )
            complete = self.state.receiver_done(attempt.receiver)
            attempt.receivers_done = len(self.state.done)
            if complete:
                self._finish("completed")
        except EngineError as exc:
            if exc.call == "transfer":  # the ledger counts its own register failures
                self._observer.engine_error(exc.call, exc.code)
            log.error("send failed: %s", exc, extra={"req_id": self.req_id})
            attempt.error = _bare(exc)
        except RequestError as exc:
            attempt.error = _bare(exc)
        except Exception as exc:
            self._fail_unexpectedly(exc)
        finally:
            if not attempt.succeeded and attempt.error is None:
                attempt.error = self._why_not_served()
            if self._attempts.get(attempt.receiver) is attempt:
                del self._attempts[attempt.receiver]
            attempt.done.set()

    async def _register_once(self) -> list[tuple[int, int]]:
        """Wait for the embedding and lease its memory; siblings share the first leases.

        An embedding in the registered arena is covered by the arena's own registration, so
        leasing its segments asks the engine nothing; any other embedding is registered here,
        once for the request.
        """
        if not self._encoded.is_set():
            await self._encoded.wait()
        if self._embedding is None:
            raise self._why_not_served()
        if self._leases is not None:  # a sibling leased them: no lock, no scheduler pass
            return list(self._embedding.segments)
        async with self._register_lock:
            if self._leases is None:
                try:
                    self._leases = await self._lease_all(self._embedding)
                except PartialOverlap:
                    # Our bytes straddle memory we cannot lease: send from a private copy.
                    original, self._embedding = self._embedding, self._embedding.copy()
                    original.release()
                    self._leases = await self._lease_all(self._embedding)
        return list(self._embedding.segments)

    async def _lease_all(self, embedding: EmbeddingMemory) -> list[Lease]:
        """One ledger lease per distinct segment; all or none."""
        leases: list[Lease] = []
        try:
            for address, nbytes in dict.fromkeys(embedding.segments):
                leases.append(await self._ledger.acquire(address, nbytes, owner=embedding))
        except BaseException:
            with trio.CancelScope(shield=True):
                for lease in leases:
                    try:
                        await self._ledger.release(lease)
                    except EngineError as exc:
                        log.error("deregister failed: %s", exc, extra={"req_id": self.req_id})
            raise
        return leases

    def _end(self, reason: EndReason, failure: Failure | None = None) -> EndReason:
        """Start ending (the state keeps the first reason); returns the reason that stands."""
        return self.state.end(reason, failure)

    def _finish(self, reason: EndReason, failure: Failure | None = None) -> None:
        self._end(reason, failure)
        self._finished.set()

    def _fail_unexpectedly(self, exc: Exception) -> None:
        """A bug, not a client's or the engine's fault: end this request only, loudly."""
        log.error(
            "request failed unexpectedly: %r", exc, exc_info=exc, extra={"req_id": self.req_id}
        )
        self._end("failed", Failure(InternalError, f"internal error: {type(exc).__name__}"))
        self._finished.set()

    async def _release(self) -> None:
        """Give the leases back, then the embedding (its arena segments, its memory); in that
        order, exactly once.

        If the engine refuses to deregister, the ledger keeps the memory alive itself (the
        lease's owner) until a retry succeeds, so dropping our reference never frees bytes the
        engine may still have registered. Arena segments are not registered on their own, and
        go back to the arena only after every transfer that reads them has returned; if the
        engine stopped waiting for one that may still read them, the ledger holds both until
        it has ended (:meth:`RegistrationLedger.keep_while_read`).
        """
        leases, self._leases = self._leases or [], None
        self._held.give_back(self._held_ranges)  # counted as held by live scopes until now
        self._held_ranges = []
        embedding = self._embedding
        if embedding is not None and self._ledger.keep_while_read(leases, embedding.release):
            # A transfer the engine stopped waiting for may still read the embedding: the
            # ledger keeps the leases and the segments until it has ended.
            self._embedding = embedding = None
            return
        embedding = None
        try:
            for lease in leases:
                try:
                    await self._ledger.release(lease)
                except EngineError as exc:
                    log.error("deregister failed: %s", exc, extra={"req_id": self.req_id})
        finally:
            # No local names the embedding: a logged traceback keeps this frame's locals.
            if self._embedding is not None:
                self._embedding.release()
            self._embedding = None

    def _why_not_served(self) -> RequestError:
        """The error for a call that the scope can no longer serve."""
        return refusal(self.req_id, self.ended())


def _bare(error: E) -> E:
    """``error`` itself stripped of its traceback and chained exceptions, to be kept (each
    waiter raises a fresh copy). Stripped in place, not copied: the log line about it may keep
    the object, and its frames hold the embedding (and the attempt keeping the error, a
    cycle), so memory the ledger has released would stay alive until the collector ran."""
    error.__traceback__ = None
    error.__context__ = None
    error.__cause__ = None
    return error
