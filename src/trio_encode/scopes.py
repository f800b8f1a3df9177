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
from dataclasses import replace

import trio

from trio_encode.ending import Ended, late_call
from trio_encode.engine import TransferEngine
from trio_encode.errors import ShuttingDown, UnknownRequest
from trio_encode.ledger import RegistrationLedger
from trio_encode.observer import LifecycleObserver, NullObserver
from trio_encode.recent import Recent
from trio_encode.request_types import Encode, EndReason
from trio_encode.scope import RequestScope, ScopeParts

# Ends that leave no tombstone: the same req_id may be tried again at once.
_FORGOTTEN: frozenset[EndReason] = frozenset({"invalid_input", "refused"})


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
        self._released: Recent[str, Ended] = Recent(remember_released, remember_seconds)
        """Tombstones: how each request that ended lately ended."""
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
        scope = self._scopes.get(req_id)
        if scope is not None:
            scope.check_receive_count(receive_count)
            return scope
        late_call("encode", req_id, self.ended(req_id), closed=self.closed)
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

    def live(self, req_id: str) -> RequestScope | None:
        """The live scope for ``req_id``, or None (ended or never seen)."""
        return self._scopes.get(req_id)

    def ended(self, req_id: str) -> Ended | None:
        """How ``req_id`` ended, if it ended lately (its tombstone); None if it is live,
        never seen, left no tombstone (bad input, a refusal) or ended too long ago."""
        return self._released.get(req_id)

    def require_live(self, req_id: str) -> RequestScope:
        """The live scope for ``req_id``; raises what a late call gets if it ended, else 404."""
        scope = self._scopes.get(req_id)
        if scope is not None:
            return scope
        late_call("send", req_id, self.ended(req_id))
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
            assert scope.end_reason is not None
            if scope.end_reason not in _FORGOTTEN:
                self._remember(scope)

    def _remember(self, scope: RequestScope) -> None:
        self._released.remember(scope.req_id, replace(scope.ended(), gone=True))
