"""The health tracker on the mock clock: down for a period that grows with each failure,
back at once on success, never dropped from a ranking."""

from __future__ import annotations

import pytest
import trio

from trio_encode.client.health import HealthTracker

A, B, C = "http://a", "http://b", "http://c"


async def test_a_failure_marks_down_for_a_period_that_doubles_up_to_a_cap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    health = HealthTracker(down_seconds=2.0, max_down_seconds=5.0)
    health.mark_down(A)
    assert not health.is_up(A)
    assert health.down() == [A]
    await trio.sleep(1.9)
    assert not health.is_up(A)
    await trio.sleep(0.2)
    assert health.is_up(A)  # period over: the next request may try it
    assert health.down() == []

    health.mark_down(A)  # failed again: 4 s
    await trio.sleep(3.9)
    assert not health.is_up(A)
    await trio.sleep(0.2)
    assert health.is_up(A)
    health.mark_down(A)  # 8 s, capped at 5
    await trio.sleep(5.0)
    assert health.is_up(A)


async def test_success_brings_an_encoder_back_and_resets_its_period(
    autojump_clock: trio.testing.MockClock,
) -> None:
    health = HealthTracker(down_seconds=2.0)
    health.mark_down(A)
    health.mark_down(A)
    health.mark_up(A)
    assert health.is_up(A)
    health.mark_down(A)
    await trio.sleep(2.0)
    assert health.is_up(A)  # 2 s again, not 8


async def test_down_encoders_go_last_in_their_own_order_never_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    health = HealthTracker(down_seconds=1.0)
    health.mark_down(A)
    health.mark_down(C)
    assert health.order([C, A, B]) == [B, C, A]
    await trio.sleep(1.0)
    assert health.order([C, A, B]) == [C, A, B]


def test_forget_drops_encoders_no_longer_listed() -> None:
    clock = [0.0]
    health = HealthTracker(down_seconds=1.0, clock=lambda: clock[0])
    health.mark_down(A)
    health.mark_down(B)
    health.forget([B])
    assert health.down() == [B]


def test_bad_periods_are_refused() -> None:
    with pytest.raises(ValueError, match="down_seconds"):
        HealthTracker(down_seconds=0)
    with pytest.raises(ValueError, match="down_seconds"):
        HealthTracker(down_seconds=5, max_down_seconds=1)
