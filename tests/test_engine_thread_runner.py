"""Handing an engine call to a worker thread without a pass through Trio's scheduler.

Under load every scheduler pass before a transfer's thread starts costs the send the time
the event loop takes to run every other ready task once; these tests pin that a free token
starts the thread at once, and that the usual thread rules still hold: a caller cancelled
before the start never runs the call, a started call is never abandoned, a full limiter makes
the caller wait, and the call's exception reaches the caller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio
import trio.testing

from trio_encode.engine import threads
from trio_encode.engine.threads import EngineThreads, run_in_thread


class StepCounter(trio.abc.Instrument):
    """Counts the scheduler's steps of one task: a step more means the task yielded."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


@contextmanager
def counting_steps() -> Iterator[StepCounter]:
    counter = StepCounter(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(counter)
    try:
        yield counter
    finally:
        trio.lowlevel.remove_instrument(counter)


async def test_a_free_token_starts_the_thread_without_a_scheduler_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps_at_start: list[int] = []
    start = trio.lowlevel.start_thread_soon

    with counting_steps() as counter:

        def recording(fn: Callable[[], Any], deliver: Callable[[Any], object]) -> None:
            steps_at_start.append(counter.steps)
            start(fn, deliver)

        monkeypatch.setattr(threads.trio.lowlevel, "start_thread_soon", recording)
        before = counter.steps
        assert await run_in_thread(lambda: 42, trio.CapacityLimiter(1)) == 42
    assert steps_at_start == [before]


async def test_a_free_session_slot_is_taken_without_a_scheduler_pass() -> None:
    engine_threads = EngineThreads()
    with counting_steps() as counter:
        before = counter.steps
        async with engine_threads.session_slot("rank-0"):
            assert counter.steps == before
            assert engine_threads.sends_in_flight("rank-0") == 1
    assert engine_threads.sends_in_flight("rank-0") == 0


async def test_a_cancelled_caller_never_starts_the_call() -> None:
    called = threading.Event()
    with trio.CancelScope() as scope:
        scope.cancel()
        await run_in_thread(called.set, trio.CapacityLimiter(1))
    assert scope.cancelled_caught
    assert not called.is_set()


async def test_a_started_call_is_waited_for_even_when_the_caller_is_cancelled() -> None:
    release = threading.Event()
    finished = threading.Event()
    limiter = trio.CapacityLimiter(1)

    def slow() -> None:
        release.wait(5)
        finished.set()

    scope = trio.CancelScope()

    async def cancel_then_release() -> None:
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()
        await trio.sleep(0.05)
        assert not finished.is_set()  # still running, and its caller has not left
        release.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_then_release)
        with scope:
            await run_in_thread(slow, limiter)
            assert finished.is_set()  # returned only once the call had ended
            await trio.lowlevel.checkpoint()  # where the cancellation is delivered
    assert scope.cancelled_caught
    assert finished.is_set()
    assert limiter.borrowed_tokens == 0


async def test_a_full_limiter_makes_the_caller_wait_for_a_token() -> None:
    limiter = trio.CapacityLimiter(1)
    first_release = threading.Event()
    order: list[str] = []

    def first() -> None:
        first_release.wait(5)
        order.append("first")

    def second() -> None:
        order.append("second")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_in_thread, first, limiter)
        await trio.testing.wait_all_tasks_blocked()
        assert limiter.borrowed_tokens == 1
        nursery.start_soon(run_in_thread, second, limiter)
        await trio.testing.wait_all_tasks_blocked()
        assert order == []  # the second waits for the token, not for a thread
        assert limiter.statistics().tasks_waiting == 1
        first_release.set()
    assert order == ["first", "second"]
    assert limiter.borrowed_tokens == 0


async def test_the_calls_exception_reaches_the_caller_and_the_token_returns() -> None:
    limiter = trio.CapacityLimiter(1)

    def fails() -> None:
        raise ValueError("from the thread")

    with pytest.raises(ValueError, match="from the thread"):
        await run_in_thread(fails, limiter)
    assert limiter.borrowed_tokens == 0
