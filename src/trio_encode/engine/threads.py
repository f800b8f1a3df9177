"""Capacity for engine calls, split so that one stuck peer cannot starve the rest.

Every Mooncake call blocks a thread. A transfer holds one only while it submits its batches
(``transfer_submit_write``, fast once a receiver is contacted); the wait for their terminal
status holds none (one poller per engine watches every batch in flight, see
:mod:`trio_encode.engine.mooncake`). What a transfer to a peer that stops answering (a paused
process, a wedged NIC) holds until Mooncake's own timeout is slots, not threads:

- transfers and control calls (register, deregister) have separate thread limiters: a release
  never waits behind submissions;
- each receiver session may have at most ``sends_per_session`` transfers in flight: a frozen
  rank parks only its own sends;
- each receiver *host* at most ``sends_per_host``: a frozen node (all its TP ranks, one engine
  each) parks only its own sends too;
- the engine at most ``transfers_in_flight``, whatever receivers they name: the bound on the
  memory that transfers being waited for pin (the server gives one client at most half of it,
  see ``max_sends_per_client``).

A bound's limiter exists only while a send holds or waits for it, so receivers come and go
(every rank restart brings a new session id) without the map growing.

Waiting for a slot or a thread is a checkpoint a cancelled caller leaves from without starting
its call; once a thread runs, the call runs to completion (the engines never abandon a thread).

Every pass through Trio's scheduler on the way to a thread costs a send the time the event loop
takes to run every other ready task once, which under load is a good part of a millisecond.
So :func:`run_in_thread` and :meth:`EngineThreads.session_slot` take a free token without
yielding first (``trio.to_thread.run_sync`` always yields once, even when a thread is free);
they still leave at once when the caller is already cancelled, and still wait when no token
is free.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")


async def _acquire(limiter: trio.CapacityLimiter, borrower: object) -> None:
    """A token for ``borrower``: at once when one is free, else after waiting for one."""
    await trio.lowlevel.checkpoint_if_cancelled()
    try:
        limiter.acquire_on_behalf_of_nowait(borrower)
    except trio.WouldBlock:
        await limiter.acquire_on_behalf_of(borrower)


async def run_in_thread(
    fn: Callable[[], T],
    limiter: trio.CapacityLimiter,
    *,
    starting: Callable[[], None] | None = None,
    on_cancel: Callable[[], None] | None = None,
) -> T:
    """``fn()`` in a worker thread holding a token of ``limiter``; its result or exception.

    ``trio.to_thread.run_sync(fn, limiter=limiter, abandon_on_cancel=False)`` without the
    scheduler pass it makes before starting the thread. A caller cancelled before the thread
    starts leaves without running ``fn``; once it runs, the caller waits for it to finish
    (never abandoned) and sees the cancellation at its next checkpoint. ``starting`` is
    called once the token is held, right before the thread starts (no checkpoint between);
    ``on_cancel`` when the caller is cancelled while the thread runs (``fn`` may then stop
    early; the caller still waits for it).
    """
    task = trio.lowlevel.current_task()

    def done(result: outcome.Outcome[T]) -> None:
        trio.lowlevel.reschedule(task, outcome.Value(result))

    await start_in_thread(fn, limiter, starting=starting, done=done)

    def never_abandon(_: Any) -> trio.lowlevel.Abort:
        if on_cancel is not None:
            on_cancel()
        return trio.lowlevel.Abort.FAILED

    result: outcome.Outcome[T] = await trio.lowlevel.wait_task_rescheduled(never_abandon)
    return result.unwrap()


async def start_in_thread(
    fn: Callable[[], T],
    limiter: trio.CapacityLimiter,
    *,
    starting: Callable[[], None] | None = None,
    done: Callable[[outcome.Outcome[T]], None],
) -> None:
    """Start ``fn()`` in a worker thread holding a token of ``limiter``, and return without
    waiting for it: ``done`` gets its outcome in Trio's thread, as the token is released.

    For a caller that waits for something else the thread leads to (a transfer's batches,
    which the engine's poller watches), so that the thread's end costs no scheduler pass of
    the caller. Waiting for the token is as in :func:`run_in_thread` (a caller cancelled
    before the start leaves without running ``fn``; ``starting`` right before the start)."""
    borrower = object()
    await _acquire(limiter, borrower)
    if starting is not None:
        starting()
    token = trio.lowlevel.current_trio_token()

    def back_in_trio(result: outcome.Outcome[T]) -> None:
        limiter.release_on_behalf_of(borrower)
        done(result)

    def deliver(result: outcome.Outcome[T]) -> None:
        token.run_sync_soon(back_in_trio, result)

    try:
        trio.lowlevel.start_thread_soon(fn, deliver)
    except BaseException:
        limiter.release_on_behalf_of(borrower)
        raise


@dataclass(frozen=True)
class ThreadSettings:
    """How many worker threads engine calls, and how many transfers, may hold at once."""

    transfer_threads: int = 32
    """Transfers submitting at once, across all receivers (a transfer holds a thread only
    while it submits, not while it waits for its batches to end)."""
    control_threads: int = 4
    """Register and deregister calls in flight (kept apart so releases never queue behind
    transfers)."""
    sends_per_session: int = 8
    """Transfers in flight to any one receiver engine (``session_id``): a receiver that stops
    answering parks at most this many."""
    sends_per_host: int = 16
    """Transfers in flight to all the receiver engines of one host (the ``session_id``'s host
    part): a node that stops answering parks at most this many."""
    transfers_in_flight: int = 1024
    """Transfers in flight across all receivers, from their first slot until their caller
    stops waiting: bounds the memory that sends to frozen receivers pin."""

    def __post_init__(self) -> None:
        for name in (
            "transfer_threads",
            "control_threads",
            "sends_per_session",
            "sends_per_host",
            "transfers_in_flight",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class EngineThreads:
    """The limiters one engine's calls borrow their threads from."""

    def __init__(self, settings: ThreadSettings | None = None) -> None:
        self.settings = settings if settings is not None else ThreadSettings()
        self.transfers = trio.CapacityLimiter(self.settings.transfer_threads)
        self.control = trio.CapacityLimiter(self.settings.control_threads)
        self.in_flight = trio.CapacityLimiter(self.settings.transfers_in_flight)
        """The engine-wide bound on transfers in flight (see :meth:`session_slot`)."""
        self._sessions: dict[str, trio.CapacityLimiter] = {}
        self._hosts: dict[str, trio.CapacityLimiter] = {}

    @property
    def bounds_held(self) -> int:
        """Per-session and per-host limiters alive now (one per receiver and host that has a
        send holding or waiting for a slot)."""
        return len(self._sessions) + len(self._hosts)

    def sends_in_flight(self, session_id: str) -> int:
        """Transfers holding (or waiting for) a thread for ``session_id`` now."""
        return _in_use(self._sessions.get(session_id))

    def host_sends_in_flight(self, host: str) -> int:
        """Transfers holding (or waiting for) a slot of ``host``'s bound now."""
        return _in_use(self._hosts.get(host))

    @asynccontextmanager
    async def session_slot(self, session_id: str) -> AsyncIterator[None]:
        """Hold one of ``session_id``'s send slots, one of its host's and one of the engine's
        for the body (a transfer to it, submission and wait). Taken narrowest first: a send
        queued behind its own rank's (or node's) bound holds nothing the others need."""
        async with (
            _slot(self._sessions, session_id, self.settings.sends_per_session),
            _slot(self._hosts, host_of(session_id), self.settings.sends_per_host),
        ):
            token = object()
            await _acquire(self.in_flight, token)
            try:
                yield
            finally:
                self.in_flight.release_on_behalf_of(token)


def host_of(session_id: str) -> str:
    """The host part of a ``host:port`` session id (the whole id if it names no port)."""
    host, colon, port = session_id.rpartition(":")
    return host if colon and port.isdigit() else session_id


def _in_use(limiter: trio.CapacityLimiter | None) -> int:
    if limiter is None:
        return 0
    stats = limiter.statistics()
    return stats.borrowed_tokens + stats.tasks_waiting


@asynccontextmanager
async def _slot(
    limiters: dict[str, trio.CapacityLimiter], key: str, capacity: int
) -> AsyncIterator[None]:
    """Hold one token of ``key``'s limiter (made on first use, dropped when unused)."""
    limiter = limiters.get(key)
    if limiter is None:
        limiter = limiters[key] = trio.CapacityLimiter(capacity)
    token = object()
    try:
        await _acquire(limiter, token)
        try:
            yield
        finally:
            limiter.release_on_behalf_of(token)
    finally:
        if _in_use(limiter) == 0:
            limiters.pop(key, None)
