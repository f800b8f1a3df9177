"""Waiting for submitted Mooncake transfers: pauses that grow with the wait, never a spin.

The binding's own synchronous calls check the transfer's status in a loop with no pause, so
each transfer in flight kept a core busy; these tests pin the replacement's behaviour with a
fake clock.
"""

from __future__ import annotations

import pytest

from trio_encode.engine import Write
from trio_encode.engine.mooncake import transfer_timeout, wait_until_done, write_segments


class FakeTime:
    """A clock that moves only when the waiter sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Transfer:
    """A submitted transfer that ends (with ``status``) once the fake clock reaches ``when``."""

    def __init__(self, time: FakeTime, when: float, status: int = 1) -> None:
        self.time, self.when, self.status = time, when, status
        self.checks = 0

    def __call__(self) -> int:
        self.checks += 1
        return self.status if self.time.now >= self.when else 0


def test_a_long_transfer_is_checked_a_few_dozen_times_not_millions() -> None:
    time = FakeTime()
    transfer = Transfer(time, 0.050)
    assert wait_until_done([transfer], 30.0, clock=time.clock, sleep=time.sleep) == (0, [])
    assert transfer.checks < 200  # a loop with no pause makes millions
    # The pause grows with the time waited, so the answer comes at most ~1/8 late.
    assert time.now < 0.050 * 1.15 + 1e-3


def test_a_short_transfer_is_seen_within_microseconds() -> None:
    time = FakeTime()
    assert (
        wait_until_done([Transfer(time, 50e-6)], 30.0, clock=time.clock, sleep=time.sleep)[0] == 0
    )
    assert time.now < 120e-6


def test_no_pause_is_longer_than_a_millisecond() -> None:
    time = FakeTime()
    wait_until_done([Transfer(time, 2.0)], 30.0, clock=time.clock, sleep=time.sleep)
    assert max(time.sleeps) <= 1e-3


def test_a_failure_is_reported_after_every_other_transfer_ended() -> None:
    time = FakeTime()
    failed, slow = Transfer(time, 0.001, status=-1), Transfer(time, 0.040)
    code, pending = wait_until_done([failed, slow], 30.0, clock=time.clock, sleep=time.sleep)
    assert (code, pending) == (-1, [])
    assert time.now >= 0.040  # it still waited for the slow one, which reads our memory
    assert failed.checks < slow.checks  # an ended transfer is not asked again


def test_a_transfer_that_never_ends_times_out_and_is_handed_back_pending() -> None:
    time = FakeTime()
    endless = Transfer(time, float("inf"))
    assert wait_until_done([endless], 0.5, clock=time.clock, sleep=time.sleep) == (-1, [endless])
    assert 0.5 <= time.now < 0.502


def test_mooncakes_own_timeout_status_is_not_an_end() -> None:
    """-2 (Mooncake's TIMEOUT) means the batch still runs and still reads our memory: it is
    asked again until it ends, and handed back pending if it never does."""
    time = FakeTime()
    late = Transfer(time, 0.030)
    late.status = 1
    before = Transfer(time, 0.0, status=-2)

    def timed_out_then_done() -> int:
        return late() if time.now >= 0.030 else before()

    assert wait_until_done([timed_out_then_done], 1.0, clock=time.clock, sleep=time.sleep) == (
        0,
        [],
    )
    assert time.now >= 0.030
    stuck = Transfer(time, 0.0, status=-2)
    assert wait_until_done([stuck], 0.1, clock=time.clock, sleep=time.sleep) == (-1, [stuck])


def test_nothing_submitted_is_done_at_once() -> None:
    time = FakeTime()
    assert wait_until_done([], 1.0, clock=time.clock, sleep=time.sleep) == (0, [])
    assert time.sleeps == []


def test_the_timeout_follows_mooncakes_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    assert transfer_timeout(10**9) == 31.0
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "2")
    assert transfer_timeout(0) == 5.0


class FakeMooncake:
    """The two binding calls a write makes: submissions answered from a script, and every
    status check recorded (every batch is done when asked)."""

    def __init__(self, batch_ids: list[int]) -> None:
        self.batch_ids = batch_ids
        self.submitted: list[int] = []
        self.asked: list[int] = []

    def transfer_submit_write(self, session_id: str, address: int, remote: int, n: int) -> int:
        self.submitted.append(address)
        return self.batch_ids.pop(0)

    def transfer_check_status(self, batch_id: int) -> int:
        self.asked.append(batch_id)
        return 1


def test_a_refused_submission_ends_the_write() -> None:
    """A submission Mooncake refuses (-1: no batch) ends the call: no later segment is
    submitted, the refused one is never asked about (it is no batch), and the ones already
    submitted are waited for."""
    raw = FakeMooncake([7, -1, 9])
    segments = [(0x1000, 16), (0x2000, 16), (0x3000, 16)]
    assert write_segments(raw, Write("peer:1", segments, 0x9000)) == (-1, [])
    assert raw.submitted == [0x1000, 0x2000]
    assert raw.asked == [7]
