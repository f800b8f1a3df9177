"""A scope's closing line and event: how long it lived, what it sent, to how many receivers.

An operator reads one line per request to learn its end; metrics read the same duration.
"""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from support.lifecycle_rig import gather_sends, lifecycle_rig

NBYTES = 64 * 32 * 4


def _closing_line(caplog: pytest.LogCaptureFixture, req_id: str) -> logging.LogRecord:
    (line,) = [
        r
        for r in caplog.records
        if r.getMessage().startswith("scope closed") and getattr(r, "req_id", None) == req_id
    ]
    return line


async def test_a_completed_scope_reports_its_duration_bytes_and_receivers(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with lifecycle_rig(transfer_latency=0.25) as rig:
        encode, _ = rig.encoder("r1", seed=1)
        encode.latency = 2.0
        with caplog.at_level(logging.INFO, logger="trio_encode"):
            await rig.open("r1", encode, receive_count=2)
            ranks = await rig.landings(2)
            await trio.sleep(1.0)  # the encoder is still running when the siblings call
            await gather_sends(rig, "r1", [r.receiver for r in ranks])
            await trio.testing.wait_all_tasks_blocked()
        line = _closing_line(caplog, "r1")
        assert line.getMessage() == "scope closed: completed"
        assert line.duration_s == pytest.approx(2.25)  # type: ignore[attr-defined]
        assert line.bytes_sent == 2 * NBYTES  # type: ignore[attr-defined]
        assert line.receivers == "2/2"  # type: ignore[attr-defined]
        assert rig.observer.scope_seconds["r1"] == pytest.approx(2.25)
        await rig.assert_nothing_held()


async def test_an_expired_scope_reports_what_it_managed_before_its_deadline(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with lifecycle_rig(send_timeout=30) as rig:
        encode, _ = rig.encoder("r2", seed=2)
        with caplog.at_level(logging.INFO, logger="trio_encode"):
            await rig.open("r2", encode, receive_count=3)
            (rank,) = await rig.landings(1)
            await gather_sends(rig, "r2", [rank.receiver])
            await rig.registry.require_live("r2").wait_ended()
        line = _closing_line(caplog, "r2")
        assert line.getMessage() == "scope closed: expired"
        assert line.duration_s == pytest.approx(30)  # type: ignore[attr-defined]
        assert (line.bytes_sent, line.receivers) == (NBYTES, "1/3")  # type: ignore[attr-defined]
        assert rig.observer.scope_seconds["r2"] == pytest.approx(30)
        await rig.assert_nothing_held()
