"""ScopeRegistry: the live request scopes by ``req_id``, and the one bounded memory of ended
requests.

The registry owns no nursery; it starts each scope in the service nursery it is given, which
outlives every HTTP handler. An ended request leaves a tombstone (its state frozen: how it
ended, its error's class and message, its shape and the receivers that got their bytes), and
so does a request refused for bad input before any scope opened; a late call gets the answer
:func:`~trio_encode.request_state.answer` gives from it rather than a fresh scope: 410, the
original error, or, for a receiver already served that lost its answer, the same 200 again.
Tombstones never hold an exception, a frame or an embedding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from trio_encode.engine import TransferEngine
from trio_encode.held import HeldMemory
from trio_encode.ledger import RegistrationLedger
from trio_encode.observer import LifecycleObserver, NullObserver
from trio_encode.recent import Recent
from trio_encode.request_state import Call, Ended, Failure, answer
from trio_encode.request_types import Encode, Receiver, SendReport
from trio_encode.scope import RequestScope, ScopeParts

OnEnd = Callable[[Ended], None]
"""Told a request's tombstone once its scope has released everything; must not raise."""


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
        self.held = HeldMemory()
        """Embedding bytes the live scopes hold, each memory range once."""
        self._parts = ScopeParts(engine, ledger, observer or NullObserver(), self.held)
        self.send_timeout = send_timeout
        self._scopes: dict[str, RequestScope] = {}
        self._released: Recent[str, Ended] = Recent(remember_released, remember_seconds)
        """Tombstones: how each request that ended lately ended."""
        self.closed = False
        """Set at shutdown: no new scope opens."""

    def is_closed(self) -> bool:
        return self.closed

    def __len__(self) -> int:
        return len(self._scopes)

    def scopes(self) -> list[RequestScope]:
        return list(self._scopes.values())

    async def open(
        self,
        req_id: str,
        *,
        receive_count: int | None,
        encode: Encode,
        on_end: OnEnd | None = None,
    ) -> RequestScope:
        """The scope for ``req_id``, started on first use; siblings get the same scope.

        ``on_end`` is told the request's tombstone when its scope has released everything.
        The start is shielded: a caller whose client has gone away (a cancellation pending
        from its own wait) must not hand that cancellation to a scope its siblings share.
        """
        scope = self._scopes.get(req_id)
        if scope is not None:
            scope.check_receive_count(receive_count)
            return scope
        self.answer("encode", req_id)
        scope = RequestScope(
            req_id,
            self._parts,
            receive_count=receive_count,
            deadline=trio.current_time() + self.send_timeout,
            encode=encode,
        )
        self._scopes[req_id] = scope
        with trio.CancelScope(shield=True):
            await self._nursery.start(self._run_scope, scope, on_end)
        return scope

    def live(self, req_id: str) -> RequestScope | None:
        """The live scope for ``req_id``, or None (ended or never seen)."""
        return self._scopes.get(req_id)

    def ended(self, req_id: str) -> Ended | None:
        """How ``req_id`` ended, if it ended lately (its tombstone); None if it is live (and
        has not ended before), never seen, or ended too long ago."""
        return self._released.get(req_id)

    def answer(
        self,
        call: Call,
        req_id: str,
        *,
        receiver: Receiver | None = None,
        family_failure: Failure | None = None,
    ) -> SendReport | None:
        """What ``call`` gets for ``req_id`` with no live scope: see
        :func:`~trio_encode.request_state.answer`, given its tombstone and whether the server
        is closing."""
        return answer(
            call,
            req_id,
            self.ended(req_id),
            receiver=receiver,
            family_failure=family_failure,
            closed=self.closed,
        )

    def require_live(self, req_id: str) -> RequestScope:
        """The live scope for ``req_id``; raises what a late ``/send`` gets otherwise."""
        scope = self._scopes.get(req_id)
        if scope is None:
            self.answer("send", req_id)
            raise AssertionError("a send with no live scope always gets an answer")
        return scope

    def refused(self, req_id: str, failure: Failure) -> None:
        """Remember a request refused before its scope opened (bad input), for its late pulls
        and sends; a corrected ``/encode`` may still reuse the id."""
        tombstone = Ended("invalid_input", failure, None, frozenset(), None, gone=True)
        self._released.remember(req_id, tombstone)

    async def _run_scope(
        self,
        scope: RequestScope,
        on_end: OnEnd | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            await scope.run(task_status=task_status)
        finally:
            del self._scopes[scope.req_id]
            tombstone = scope.tombstone
            assert tombstone is not None  # run() always releases
            self._released.remember(scope.req_id, tombstone)
            if on_end is not None:
                on_end(tombstone)
