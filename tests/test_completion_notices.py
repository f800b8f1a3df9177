"""Failure notices on the mock clock: bounded per client and in all, one log line each,
and a push that raises never reaches the nursery."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.lowlevel
import trio.testing

from support.lifecycle_rig import RecordingObserver
from trio_encode.completion import Endpoint, FailureNotices, Kind
from trio_encode.completion import pusher as notices_module
from trio_encode.errors import CompletionFailed
from trio_encode.observer import TaskFaults


class ScriptedPusher:
    """A pusher on the mock clock: a push to a ``dead`` endpoint fails at ``timeout``, one to
    a ``broken`` endpoint raises a bug, any other is delivered at once and recorded. With
    ``error_slots``, error pushes take turns for that many slots (as the real pusher's share
    of its sockets)."""

    def __init__(self, *, timeout: float = 5.0, error_slots: int | None = None) -> None:
        self.timeout = timeout
        self.error_slots = None if error_slots is None else trio.CapacityLimiter(error_slots)
        self.dead: set[Endpoint] = set()
        self.broken: set[Endpoint] = set()
        self.delivered: list[tuple[Endpoint, bytes, Kind, float]] = []
        self.in_flight: dict[Kind, int] = {"done": 0, "error": 0}
        self.most_in_flight: dict[Kind, int] = {"done": 0, "error": 0}

    def to(self, endpoint: Endpoint, kind: Kind | None = None) -> list[bytes]:
        """The messages delivered to ``endpoint`` (of ``kind``), in order."""
        return [m for e, m, k, _ in self.delivered if e == endpoint and kind in (None, k)]

    async def push(self, endpoint: Endpoint, message: bytes, *, kind: Kind) -> None:
        if kind == "error" and self.error_slots is not None:
            async with self.error_slots:
                await self._push(endpoint, message, kind)
        else:
            await self._push(endpoint, message, kind)

    async def _push(self, endpoint: Endpoint, message: bytes, kind: Kind) -> None:
        self.in_flight[kind] += 1
        self.most_in_flight[kind] = max(self.most_in_flight[kind], self.in_flight[kind])
        try:
            if endpoint in self.broken:
                raise RuntimeError("a bug in the pusher")
            if endpoint in self.dead:
                await trio.sleep(self.timeout)
                raise CompletionFailed(f"nobody at {endpoint.address}")
            await trio.lowlevel.checkpoint()
            self.delivered.append((endpoint, message, kind, trio.current_time()))
        finally:
            self.in_flight[kind] -= 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()


def endpoints(count: int, host: str = "127.0.0.1", first: int = 20000) -> list[Endpoint]:
    return [Endpoint(host, port) for port in range(first, first + count)]


@asynccontextmanager
async def running(
    pusher: ScriptedPusher, observer: RecordingObserver, **bounds: int
) -> AsyncIterator[tuple[FailureNotices, TaskFaults]]:
    faults = TaskFaults(observer)
    notices = FailureNotices(pusher, faults, observer=observer, **bounds)
    async with trio.open_nursery() as nursery:
        await nursery.start(notices.run)
        yield notices, faults
        nursery.cancel_scope.cancel()


async def test_one_clients_dead_endpoints_never_delay_another_clients_notice(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client's 64 dead endpoints are pushed 16 at a time, so they hold 16 of the pusher's
    32 slots for error pushes; another client's notice to a live rank is delivered at once,
    not behind them."""
    pusher, observer = ScriptedPusher(error_slots=32), RecordingObserver()
    dead = endpoints(64)
    pusher.dead.update(dead)
    live = Endpoint("10.0.0.2", 30000)
    async with running(pusher, observer) as (notices, _):
        notices.notify("evil", b"failed", dict.fromkeys(dead, "10.6.6.6"))
        await trio.testing.wait_all_tasks_blocked()
        notices.notify("good", b"failed too", {live: "10.0.0.1"})
        await trio.testing.wait_all_tasks_blocked()
        assert pusher.to(live) == [b"failed too"]
        assert pusher.delivered[0][3] == 0.0  # at once
        assert pusher.in_flight["error"] == notices_module.PUSHES_PER_CLIENT
        assert notices.pending == 64
        await trio.sleep(64 // 16 * 5.0 + 1)
        assert notices.pending == 0
    assert pusher.most_in_flight["error"] == notices_module.PUSHES_PER_CLIENT + 1
    # The pusher counts its own; the notices count only what they dropped.
    assert observer.names("completion_pushed") == []


async def test_pushes_beyond_the_queues_are_dropped_and_each_notice_is_one_log_line(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    pusher, observer = ScriptedPusher(), RecordingObserver()
    dead = endpoints(10)
    pusher.dead.update(dead)
    caplog.set_level(logging.INFO, logger=notices_module.__name__)
    async with running(pusher, observer, per_client=2, queued_per_client=6, queued=6) as (
        notices,
        _,
    ):
        # r1: 2 in flight, 6 waiting (the client's bound), 2 dropped.
        notices.notify("r1", b"m1", dict.fromkeys(dead, "c1"))
        # r2, another client: 2 in flight, none may wait (6 do in all), 1 dropped.
        notices.notify("r2", b"m2", dict.fromkeys(endpoints(3, first=30000), "c2"))
        await trio.sleep(100)
        assert notices.pending == 0
    lines = [(r.req_id, r.getMessage()) for r in caplog.records]  # type: ignore[attr-defined]
    assert lines == [
        ("r2", "failure told to 2 of 3 prefill endpoints (0 failed, 1 dropped)"),
        ("r1", "failure told to 0 of 10 prefill endpoints (8 failed, 2 dropped)"),
    ]
    assert observer.names("completion_pushed") == [("error", False)] * 3


async def test_a_push_that_waited_too_long_is_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Pushes queued behind a client's dead endpoints for longer than its rank would wait
    are dropped, not sent late."""
    pusher, observer = ScriptedPusher(timeout=40.0), RecordingObserver()
    dead = endpoints(2)
    pusher.dead.update(dead)
    late = Endpoint("10.0.0.2", 30000)
    async with running(pusher, observer, per_client=1) as (notices, _):
        notices.notify("r1", b"m1", dict.fromkeys(dead, "c1"))
        notices.notify("r2", b"m2", {late: "c1"})
        await trio.sleep(200)
        assert notices.pending == 0
    assert pusher.to(late) == []  # its turn came after 80 s, past QUEUED_SECONDS
    assert observer.names("completion_pushed") == [("error", False)]


async def test_a_push_that_raises_is_contained_logged_once_and_counted(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in a push ends that push alone: the nursery and the other pushes go on."""
    pusher, observer = ScriptedPusher(), RecordingObserver()
    broken, fine = Endpoint("10.0.0.9", 1), Endpoint("10.0.0.9", 2)
    pusher.broken.add(broken)
    async with running(pusher, observer) as (notices, faults):
        notices.notify("r1", b"m1", {broken: "c1", fine: "c1"})
        await trio.testing.wait_all_tasks_blocked()
        assert faults.counts == {"failure_notice": 1}
        notices.notify("r2", b"m2", {broken: "c1", fine: "c1"})
        await trio.testing.wait_all_tasks_blocked()
        assert faults.counts == {"failure_notice": 2}
        assert pusher.to(fine) == [b"m1", b"m2"]
        assert notices.pending == 0
    failures = [r for r in caplog.records if "background task" in r.getMessage()]
    assert len(failures) == 2
    assert failures[0].getMessage().startswith("background task failure_notice failed")
    assert failures[0].exc_info is not None
