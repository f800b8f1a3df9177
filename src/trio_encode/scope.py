"""RequestScope: one request's whole life, as one task with a nursery of its own.

Why a task: every TP rank sends the same embedding, so a request is shared state touched by
several HTTP handlers at once. SGLang's encode server let each ``/send`` register, transfer,
deregister and null the embedding on its own, and the siblings raced (-7 overlaps, sends of a
``None`` embedding, deregistration under a running transfer). Here a request is a task in the
service nursery; its transfers are tasks in *its* nursery; handlers only start them and wait.
So the scope's ``finally`` cannot run while a transfer is in flight, and it alone deregisters
and then drops the embedding.

The scope ends when ``receive_count`` distinct receivers are done, when the encode fails, when
the server shuts down, or when its backstop deadline (``send_timeout`` after creation) cancels it.
This module knows nothing of HTTP or torch: only the engine, the ledger and the embedding's
address and size.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import trio

from trio_encode.engine import EngineError, TransferEngine
from trio_encode.errors import (
    EncodeFailed,
    InvalidInput,
    ReceiveCountConflict,
    RequestError,
    RequestReleased,
    ScopeExpired,
    ShuttingDown,
    UnknownRequest,
)
from trio_encode.observer import LifecycleObserver, NullObserver
from trio_encode.registrations import Lease, PartialOverlap, RegistrationLedger

log = logging.getLogger(__name__)

EndReason = Literal["completed", "encode_failed", "invalid_input", "expired", "shutdown"]


class EmbeddingMemory(Protocol):
    """What a scope needs to know about an embedding: where its bytes lie, and its shape."""

    @property
    def address(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def rows(self) -> int: ...

    @property
    def dim(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    def copy(self) -> EmbeddingMemory:
        """The same bytes in fresh memory."""
        ...


Encode = Callable[[], Awaitable[EmbeddingMemory]]


@dataclass(frozen=True)
class EmbeddingShape:
    """Facts about an embedding that outlive it (answers are built after it is dropped)."""

    rows: int
    dim: int
    nbytes: int
    dtype: str


@dataclass(frozen=True)
class Receiver:
    """A landing buffer; a retry from the same one is the same receiver."""

    session_id: str
    buffer_address: int


@dataclass(frozen=True)
class SendReport:
    shape: EmbeddingShape
    receivers_done: int
    receive_count: int


@dataclass(eq=False)
class _Attempt:
    """One receiver's send in flight; a retry arriving meanwhile joins it."""

    receiver: Receiver
    done: trio.Event = field(default_factory=trio.Event)
    # Covers only the phase before the transfer starts: a client that goes away then withdraws
    # its send; once the transfer has started it completes and counts.
    withdraw: trio.CancelScope = field(default_factory=trio.CancelScope)
    waiters: int = 0
    transferring: bool = False
    succeeded: bool = False
    receivers_done: int = 0
    """Distinct receivers done when this send completed (later ones may finish first)."""
    error: Exception | None = None


class RequestScope:
    """The state and task of one ``req_id``. Created by :meth:`ScopeRegistry.open`."""

    def __init__(
        self,
        req_id: str,
        *,
        receive_count: int,
        deadline: float,
        encode: Encode,
        engine: TransferEngine,
        ledger: RegistrationLedger,
        observer: LifecycleObserver,
    ) -> None:
        self.req_id = req_id
        self.receive_count = receive_count
        self.deadline = deadline
        self.shape: EmbeddingShape | None = None
        self.end_reason: EndReason | None = None
        self._encode = encode
        self._engine = engine
        self._ledger = ledger
        self._observer = observer
        self._embedding: EmbeddingMemory | None = None
        self._encode_error: RequestError | None = None
        self._started = trio.Event()
        self._encoded = trio.Event()
        self._finished = trio.Event()
        self._ended = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._backstop = trio.CancelScope(deadline=deadline)
        self._lease: Lease | None = None
        self._register_lock = trio.Lock()
        self._attempts: dict[Receiver, _Attempt] = {}
        self._done: set[Receiver] = set()
        self._bytes_sent = 0

    # -- what handlers call -----------------------------------------------------------------

    @property
    def receivers_done(self) -> int:
        return len(self._done)

    @property
    def encode_error(self) -> RequestError | None:
        """Why the encode failed, if it did (remembered after the scope ends)."""
        return self._encode_error

    @property
    def accepting(self) -> bool:
        """Whether new sends may still join (false from the moment the scope starts ending)."""
        return (
            self._nursery is not None
            and self.end_reason is None
            and not self._backstop.cancel_called
        )

    def check_receive_count(self, receive_count: int | None) -> None:
        """Siblings must agree on how many receivers there are (409 otherwise)."""
        if receive_count is not None and receive_count != self.receive_count:
            raise ReceiveCountConflict(
                f"receive_count {receive_count} conflicts with {self.receive_count} given "
                "by an earlier call for this req_id",
                req_id=self.req_id,
            )

    def cancel(self) -> None:
        """End the scope now (server shutdown); running transfers still finish first."""
        if self.end_reason is None:
            self.end_reason = "shutdown"
        self._backstop.cancel()

    async def wait_encoded(self) -> EmbeddingShape:
        """Wait for the one encoder run; every sibling gets the same answer or error."""
        await self._encoded.wait()
        if self.shape is not None:
            return self.shape
        raise self._why_not_served()

    async def send(self, receiver: Receiver) -> SendReport:
        """Write the embedding into ``receiver`` and return once the bytes have landed.

        The transfer runs as a task in this scope's nursery, never in the caller's, so a
        caller that is cancelled cannot take a running transfer down with it.
        """
        await self._started.wait()
        if not self.accepting:
            raise self._why_not_served()
        assert self._nursery is not None
        attempt = self._attempts.get(receiver)
        if attempt is None:
            attempt = _Attempt(receiver)
            self._attempts[receiver] = attempt
            self._nursery.start_soon(self._run_attempt, attempt)
        attempt.waiters += 1
        try:
            await attempt.done.wait()
        finally:
            attempt.waiters -= 1
            if attempt.waiters == 0 and not attempt.transferring and not attempt.done.is_set():
                # Nobody waits and nothing moved yet: withdraw it, and let a retry start afresh.
                attempt.withdraw.cancel()
                if self._attempts.get(receiver) is attempt:
                    del self._attempts[receiver]
        if attempt.error is not None:
            raise attempt.error
        assert self.shape is not None
        return SendReport(self.shape, attempt.receivers_done, self.receive_count)

    async def wait_ended(self) -> None:
        """Return once the scope has released everything."""
        await self._ended.wait()

    # -- the scope's own task ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The scope's body; runs in the service nursery until the request is over."""
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
            if backstop.cancelled_caught and self.end_reason is None:
                self.end_reason = "expired"
                self._observer.backstop_expired(self.req_id)
                log.warning(
                    "backstop deadline fired with %d of %d receivers done",
                    len(self._done),
                    self.receive_count,
                    extra={"req_id": self.req_id},
                )
        finally:
            if self.end_reason is None:
                self.end_reason = "shutdown"
            self._started.set()
            self._encoded.set()
            with trio.CancelScope(shield=True):
                await self._release()
            seconds = trio.current_time() - opened_at
            self._observer.scope_closed(self.req_id, self.end_reason, seconds)
            log.info(
                "scope closed: %s",
                self.end_reason,
                extra={
                    "req_id": self.req_id,
                    "duration_s": round(seconds, 6),
                    "bytes_sent": self._bytes_sent,
                    "receivers": f"{len(self._done)}/{self.receive_count}",
                },
            )
            self._ended.set()

    async def _run_encode(self) -> None:
        try:
            embedding = await self._encode()
        except RequestError as exc:
            exc.req_id = self.req_id
            self._encode_error = exc
            self._finish("invalid_input" if isinstance(exc, InvalidInput) else "encode_failed")
        except Exception as exc:
            log.exception("encoder failed", extra={"req_id": self.req_id})
            self._encode_error = EncodeFailed(f"the encoder failed: {exc}", req_id=self.req_id)
            self._finish("encode_failed")
        else:
            self._embedding = embedding
            self.shape = EmbeddingShape(
                embedding.rows, embedding.dim, embedding.nbytes, embedding.dtype
            )
        finally:
            self._encoded.set()

    async def _run_attempt(self, attempt: _Attempt) -> None:
        try:
            with attempt.withdraw:
                address, nbytes = await self._register_once()
                attempt.transferring = True
            if not attempt.transferring:
                return  # withdrawn before its transfer started: it never happened
            started = trio.current_time()
            await self._engine.transfer(
                attempt.receiver.session_id, address, attempt.receiver.buffer_address, nbytes
            )
            attempt.succeeded = True
            self._bytes_sent += nbytes
            self._observer.transfer_finished(self.req_id, nbytes, trio.current_time() - started)
            self._done.add(attempt.receiver)
            attempt.receivers_done = len(self._done)
            if len(self._done) >= self.receive_count:
                self._finish("completed")
        except EngineError as exc:
            if exc.call == "transfer":  # the ledger counts its own register failures
                self._observer.engine_error(exc.call, exc.code)
            log.error("send failed: %s", exc, extra={"req_id": self.req_id})
            attempt.error = exc
        except RequestError as exc:
            attempt.error = exc
        finally:
            if not attempt.succeeded and attempt.error is None:
                attempt.error = self._why_not_served()
            if self._attempts.get(attempt.receiver) is attempt:
                del self._attempts[attempt.receiver]
            attempt.done.set()

    async def _register_once(self) -> tuple[int, int]:
        """Wait for the embedding and lease its memory; siblings share the first lease."""
        await self._encoded.wait()
        if self._embedding is None:
            raise self._why_not_served()
        async with self._register_lock:
            if self._lease is None:
                try:
                    self._lease = await self._ledger.acquire(
                        self._embedding.address, self._embedding.nbytes
                    )
                except PartialOverlap:
                    # Our bytes straddle another request's registration: send from a copy.
                    self._embedding = self._embedding.copy()
                    self._lease = await self._ledger.acquire(
                        self._embedding.address, self._embedding.nbytes
                    )
        return self._embedding.address, self._embedding.nbytes

    def _finish(self, reason: EndReason) -> None:
        if self.end_reason is None:
            self.end_reason = reason
        self._finished.set()

    async def _release(self) -> None:
        """Deregister (if registered), then drop the embedding; in that order, exactly once."""
        lease, self._lease = self._lease, None
        try:
            if lease is not None:
                await self._ledger.release(lease)
        except EngineError as exc:
            log.error("deregister failed: %s", exc, extra={"req_id": self.req_id})
        finally:
            self._embedding = None

    def _why_not_served(self) -> RequestError:
        """The error for a call that the scope can no longer serve."""
        if self._encode_error is not None:
            return self._encode_error
        reason = self.end_reason
        if reason is None and trio.current_time() >= self.deadline:
            reason = "expired"
        if reason == "expired":
            return ScopeExpired(
                f"the request's send_timeout expired with {len(self._done)} of "
                f"{self.receive_count} receivers done",
                req_id=self.req_id,
            )
        if reason == "completed":
            return RequestReleased(
                "the request is complete: all receivers have been sent to", req_id=self.req_id
            )
        if reason == "shutdown" or reason is None:
            return ShuttingDown("the server is shutting down", req_id=self.req_id)
        return RequestReleased(f"the request has ended ({reason})", req_id=self.req_id)


@dataclass(frozen=True)
class _Tombstone:
    reason: EndReason
    error: RequestError | None
    at: float


class ScopeRegistry:
    """The live scopes by ``req_id``, and a bounded memory of the ones that ended.

    The registry owns no nursery; it starts each scope in the service nursery it is given,
    which outlives every HTTP handler.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        engine: TransferEngine,
        ledger: RegistrationLedger,
        send_timeout: float,
        observer: LifecycleObserver | None = None,
        remember_released: int = 100_000,
        remember_seconds: float = 3600.0,
    ) -> None:
        if not send_timeout > 0 or math.isinf(send_timeout):
            raise ValueError("send_timeout must be a positive number of seconds")
        self._nursery = nursery
        self._engine = engine
        self._ledger = ledger
        self._observer: LifecycleObserver = observer or NullObserver()
        self.send_timeout = send_timeout
        self._scopes: dict[str, RequestScope] = {}
        self._released: OrderedDict[str, _Tombstone] = OrderedDict()
        self._remember_released = remember_released
        self._remember_seconds = remember_seconds
        self.closed = False

    def __len__(self) -> int:
        return len(self._scopes)

    def scopes(self) -> list[RequestScope]:
        return list(self._scopes.values())

    async def open(self, req_id: str, *, receive_count: int | None, encode: Encode) -> RequestScope:
        """The scope for ``req_id``, started on first use; siblings get the same scope."""
        scope = self.get(req_id)
        if scope is not None:
            scope.check_receive_count(receive_count)
            return scope
        if self.closed:
            raise ShuttingDown("the server is shutting down", req_id=req_id)
        scope = RequestScope(
            req_id,
            receive_count=receive_count or 1,
            deadline=trio.current_time() + self.send_timeout,
            encode=encode,
            engine=self._engine,
            ledger=self._ledger,
            observer=self._observer,
        )
        self._scopes[req_id] = scope
        await self._nursery.start(self._run_scope, scope)
        return scope

    def get(self, req_id: str) -> RequestScope | None:
        """The live scope for ``req_id``, None if there is none; 410 (or its error) if ended."""
        scope = self._scopes.get(req_id)
        if scope is None:
            self._raise_if_released(req_id)
        return scope

    def lookup(self, req_id: str) -> RequestScope:
        """The live scope for ``req_id``; 404 if never seen, 410 (or its error) if ended."""
        scope = self.get(req_id)
        if scope is not None:
            return scope
        raise UnknownRequest(
            "no /encode has named this req_id here (or it ended too long ago to remember)",
            req_id=req_id,
        )

    async def _run_scope(
        self, scope: RequestScope, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await scope.run(task_status=task_status)
        finally:
            del self._scopes[scope.req_id]
            # Bad input leaves nothing behind: the client may retry the id with a fixed body.
            if scope.end_reason != "invalid_input":
                assert scope.end_reason is not None
                self._remember(scope.req_id, scope.end_reason, scope.encode_error)

    def _remember(self, req_id: str, reason: EndReason, error: RequestError | None) -> None:
        now = trio.current_time()
        self._released[req_id] = _Tombstone(reason, error, now)
        self._released.move_to_end(req_id)
        while self._released:
            oldest = next(iter(self._released.values()))
            if (
                len(self._released) <= self._remember_released
                and now - oldest.at <= self._remember_seconds
            ):
                break
            self._released.popitem(last=False)

    def _raise_if_released(self, req_id: str) -> None:
        tomb = self._released.get(req_id)
        if tomb is None or trio.current_time() - tomb.at > self._remember_seconds:
            return
        if tomb.error is not None and tomb.reason == "encode_failed":
            raise EncodeFailed(tomb.error.message, req_id=req_id)
        raise RequestReleased(
            f"this req_id's scope has already been released ({tomb.reason})", req_id=req_id
        )
