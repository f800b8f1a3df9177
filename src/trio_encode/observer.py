"""Lifecycle events, for metrics and tests, without the lifecycle knowing about Prometheus;
and the containment of background tasks' failures (:class:`TaskFaults`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol, runtime_checkable

log = logging.getLogger(__name__)

RegistrationCall = Literal["register", "deregister"]

METRIC_PREFIX = "trio_encode_"
"""What the name of every metric the server exports begins with."""


class LifecycleObserver(Protocol):
    """Receives every lifecycle event; the server's metrics implement it."""

    def scope_opened(self, req_id: str) -> None: ...

    def scope_closed(self, req_id: str, reason: str, seconds: float) -> None:
        """The scope has released everything, ``seconds`` after it opened."""
        ...

    def registered(self, address: int, length: int) -> None: ...

    def deregistered(self, address: int) -> None: ...

    def registration_timed(self, call: RegistrationCall, seconds: float) -> None:
        """One register or deregister call took ``seconds`` (failed ones included): the cost
        the arena exists to avoid, which no transfer metric shows."""
        ...

    def transfer_finished(self, req_id: str, nbytes: int, seconds: float) -> None: ...

    def engine_error(self, call: str, code: int) -> None: ...

    def backstop_expired(self, req_id: str) -> None: ...

    def split_expired(self, req_id: str, served: int, receive_count: int) -> None:
        """The backstop ended a scope that had served some, not all, of its receivers: its
        siblings went to another encoder (a split), or some ranks never sent."""
        ...

    def quarantine_changed(self, regions: int, nbytes: int) -> None:
        """Registrations whose deregistration failed and is being retried (memory kept)."""
        ...

    def completion_pushed(self, kind: str, *, ok: bool) -> None:
        """A completion message (``kind``: done or error) was delivered to a prefill rank, or
        could not be."""
        ...

    def transfer_hold_overdue(self, nbytes: int) -> None:
        """Memory held for a transfer the engine stopped waiting for is still held past the
        ledger's ``overdue_after``: the engine never reported the transfer ended."""
        ...


class NullObserver:
    """Ignores every event."""

    def scope_opened(self, req_id: str) -> None:
        pass

    def scope_closed(self, req_id: str, reason: str, seconds: float) -> None:
        pass

    def registered(self, address: int, length: int) -> None:
        pass

    def deregistered(self, address: int) -> None:
        pass

    def registration_timed(self, call: RegistrationCall, seconds: float) -> None:
        pass

    def transfer_finished(self, req_id: str, nbytes: int, seconds: float) -> None:
        pass

    def engine_error(self, call: str, code: int) -> None:
        pass

    def backstop_expired(self, req_id: str) -> None:
        pass

    def split_expired(self, req_id: str, served: int, receive_count: int) -> None:
        pass

    def quarantine_changed(self, regions: int, nbytes: int) -> None:
        pass

    def completion_pushed(self, kind: str, *, ok: bool) -> None:
        pass

    def transfer_hold_overdue(self, nbytes: int) -> None:
        pass


@runtime_checkable
class TaskFaultObserver(Protocol):
    """Optionally implemented beside :class:`LifecycleObserver` (a separate protocol, so an
    observer written before it still fits): told of each background task that failed."""

    def background_task_failed(self, kind: str) -> None:
        """A background task of ``kind`` raised an unexpected exception (a bug); it was
        logged and contained, and nothing else stopped."""
        ...


class TaskFaults:
    """Keeps a failing background task from reaching the nursery it runs in.

    The service nursery holds every request scope: an exception escaping one of its tasks
    would cancel them all and end the process. A task run through :meth:`contain` instead
    has its exception logged once (with its kind and traceback), counted by kind here and
    through the observer, and ends alone.
    """

    def __init__(self, observer: object = None) -> None:
        self.counts: Counter[str] = Counter()
        """Contained failures by task kind (also for tests)."""
        self._observer = observer if isinstance(observer, TaskFaultObserver) else None

    def record(self, kind: str, error: Exception) -> None:
        """Count and log one contained failure of a ``kind`` task."""
        self.counts[kind] += 1
        log.error("background task %s failed: %r", kind, error, exc_info=error)
        if self._observer is not None:
            self._observer.background_task_failed(kind)

    async def contain(
        self, kind: str, task: Callable[..., Awaitable[object]], *args: object
    ) -> None:
        """Run ``task(*args)``; an :class:`Exception` from it is recorded, never raised.
        Cancellation still passes through."""
        try:
            await task(*args)
        except Exception as exc:
            self.record(kind, exc)
