"""ScopeRegistry: the live request scopes by ``req_id``, and a bounded memory of ended ones.

The registry owns no nursery; it starts each scope in the service nursery it is given, which
outlives every HTTP handler. An ended request leaves a tombstone (how it ended, its error's
class and message, its shape and the receivers that got their bytes), so a late call gets the
request's answer rather than a fresh scope: 410, the original error, or, for a receiver that
was already served and lost its answer, the same 200 again. Tombstones never hold an
exception, a frame or an embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import trio

from trio_encode.engine import TransferEngine
from trio_encode.errors import RequestReleased, ShuttingDown, UnknownRequest
from trio_encode.ledger import RegistrationLedger
from trio_encode.observer import LifecycleObserver, NullObserver
from trio_encode.recent import Recent
from trio_encode.request_types import EmbeddingShape, Encode, EndReason, Receiver, SendReport
from trio_encode.scope import Failure, RequestScope, ScopeParts

# Ends that leave no tombstone: the same req_id may be tried again at once.
_FORGOTTEN: frozenset[EndReason] = frozenset({"invalid_input", "refused"})


@dataclass(frozen=True)
class _Tombstone:
    reason: EndReason
    failure: Failure | None
    shape: EmbeddingShape | None
    done: frozenset[Receiver]
    """Receivers whose bytes landed (at most ``receive_count`` of them)."""
    receive_count: int | None


class ScopeRegistry:
    """The live scopes by ``req_id``, and a bounded memory of the ones that ended."""

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
        self._parts = ScopeParts(engine, ledger, observer or NullObserver())
        self.send_timeout = send_timeout
        self._scopes: dict[str, RequestScope] = {}
        self._released: Recent[str, _Tombstone] = Recent(remember_released, remember_seconds)
        self.closed = False
        """Set at shutdown: no new scope opens."""

    def refuse_if_closed(self, req_id: str) -> None:
        """Raise :class:`ShuttingDown` for a call that would need a new scope after shutdown
        began."""
        if self.closed:
            raise ShuttingDown(req_id=req_id)

    def __len__(self) -> int:
        return len(self._scopes)

    def scopes(self) -> list[RequestScope]:
        return list(self._scopes.values())

    async def open(self, req_id: str, *, receive_count: int | None, encode: Encode) -> RequestScope:
        """The scope for ``req_id``, started on first use; siblings get the same scope.

        The start is shielded: a caller whose client has gone away (a cancellation pending
        from its own wait) must not hand that cancellation to a scope its siblings share.
        """
        scope = self.find_live(req_id)
        if scope is not None:
            scope.check_receive_count(receive_count)
            return scope
        self.refuse_if_closed(req_id)
        scope = RequestScope(
            req_id,
            self._parts,
            receive_count=receive_count,
            deadline=trio.current_time() + self.send_timeout,
            encode=encode,
        )
        self._scopes[req_id] = scope
        with trio.CancelScope(shield=True):
            await self._nursery.start(self._run_scope, scope)
        return scope

    def find_live(self, req_id: str) -> RequestScope | None:
        """The live scope for ``req_id``; None if there is none; raises 410 (or the request's
        own error) if it has ended."""
        scope = self._scopes.get(req_id)
        if scope is None:
            self._raise_if_released(req_id)
        return scope

    def live(self, req_id: str) -> RequestScope | None:
        """The live scope for ``req_id``, or None (ended or never seen)."""
        return self._scopes.get(req_id)

    def require_live(self, req_id: str) -> RequestScope:
        """The live scope for ``req_id``; raises 404 if never seen, 410 (or its error) if
        ended."""
        scope = self.find_live(req_id)
        if scope is not None:
            return scope
        raise UnknownRequest(
            "no /encode has named this req_id here (or it ended too long ago to remember)",
            req_id=req_id,
        )

    def repeat_send(self, req_id: str, receiver: Receiver) -> SendReport | None:
        """The answer again for a receiver of a completed request that already got its bytes
        (its first 200 was lost); None if that is not the case."""
        tomb = self._released.get(req_id)
        if tomb is None:
            return None
        return SendReport.again(receiver, tomb.shape, tomb.done, tomb.receive_count)

    async def _run_scope(
        self, scope: RequestScope, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await scope.run(task_status=task_status)
        finally:
            del self._scopes[scope.req_id]
            assert scope.end_reason is not None
            if scope.end_reason not in _FORGOTTEN:
                self._remember(scope)

    def _remember(self, scope: RequestScope) -> None:
        assert scope.end_reason is not None
        self._released.remember(
            scope.req_id,
            _Tombstone(
                scope.end_reason,
                scope.failure,
                scope.shape,
                scope.done_receivers,
                scope.receive_count,
            ),
        )

    def _raise_if_released(self, req_id: str) -> None:
        tomb = self._released.get(req_id)
        if tomb is None:
            return
        if tomb.failure is not None:
            raise tomb.failure.error(req_id)
        raise RequestReleased(
            f"this req_id's scope has already been released ({tomb.reason})", req_id=req_id
        )
