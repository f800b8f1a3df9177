"""Memory a transfer may still read after the engine stopped waiting for it, on the mock clock.

Mooncake has no cancel: when its caller's wait times out, a transfer into a peer that froze goes
on, and reads its source again when the peer resumes, until Mooncake's progress timeout fails
it. The in-memory fabric models that (``transfer_timeout`` is the caller's wait,
``progress_timeout`` when the transfer really fails). The request's memory (its arena segment,
its registration) must stay out of reuse until then, or the frozen rank receives another
request's bytes.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from support.arena_rig import SEGMENT, arena_rig, fill, opener
from support.lifecycle_rig import lifecycle_rig
from trio_encode.embedding import ArenaEmbedding
from trio_encode.engine import EngineError
from trio_encode.errors import RequestError

WAIT = 5.0
"""The engine's wait for one transfer (the fabric's ``transfer_timeout``)."""
PROGRESS = 60.0
"""When a transfer into a frozen peer really fails."""
SEND_TIMEOUT = 20.0


async def test_an_arena_segment_read_by_a_transfer_given_up_on_is_never_reused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The frozen rank's send fails (502) and its request expires, yet the segment stays held;
    the next request gets other memory, and when the rank resumes it receives its own bytes."""
    async with arena_rig(
        send_timeout=SEND_TIMEOUT, transfer_timeout=WAIT, progress_timeout=PROGRESS
    ) as (rig, arena, _):
        frozen = await rig.landing(SEGMENT, name="frozen")
        first = fill(arena, 1)
        own = bytes(first[0].buffer)
        await rig.open("r1", opener(ArenaEmbedding([first])), receive_count=1)
        rig.fabric.freeze(frozen.engine.session_id)
        with pytest.raises(EngineError) as failed:
            await rig.registry.require_live("r1").send(frozen.receiver)
        assert failed.value.code == -1
        assert trio.current_time() == pytest.approx(WAIT)
        await trio.sleep(SEND_TIMEOUT)  # the request expires and releases what it can
        await trio.testing.wait_all_tasks_blocked()
        assert len(rig.registry) == 0
        assert rig.ledger.held == 1
        assert rig.ledger.held_bytes == SEGMENT
        assert rig.ledger.oldest_hold_seconds == pytest.approx(WAIT)  # held since the deadline

        second = fill(arena, 2)  # the next request's embedding
        rig.fabric.thaw(frozen.engine.session_id)  # the abandoned transfer reads its source now
        assert frozen.landed(SEGMENT) == own, "the frozen rank received another request's bytes"
        assert second[0].offset != first[0].offset
        await trio.testing.wait_all_tasks_blocked()
        assert rig.ledger.held == 0
        arena.release(second[0])
        assert arena.leased_bytes == 0, "the held segment went back once the transfer ended"
        assert rig.fabric.violations == []


async def test_a_registration_read_by_a_transfer_given_up_on_stays_until_it_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Per-request registration: the region is deregistered (and the embedding dropped) only
    once the abandoned transfer has failed at the progress timeout, never under it."""
    async with lifecycle_rig(
        send_timeout=SEND_TIMEOUT, transfer_timeout=WAIT, progress_timeout=PROGRESS
    ) as rig:
        frozen = await rig.landing(name="frozen")
        encode, alive = rig.encoder("r1", seed=3)
        await rig.open("r1", encode)
        rig.fabric.freeze(frozen.engine.session_id)
        with pytest.raises(EngineError):
            await rig.registry.require_live("r1").send(frozen.receiver)
        await trio.sleep(SEND_TIMEOUT)
        await trio.testing.wait_all_tasks_blocked()
        assert len(rig.registry) == 0
        assert rig.ledger.live_registrations == 1, "deregistered under a transfer"
        assert alive() is not None, "the embedding was dropped under a transfer"
        await trio.sleep_until(PROGRESS + 1)  # the transfer has failed by now
        await trio.testing.wait_all_tasks_blocked()
        assert rig.ledger.held == 0
        assert alive() is None
        await rig.assert_nothing_held()
        assert frozen.landed(64) == bytes(64), "a failed transfer wrote nothing"


async def test_a_hold_that_never_ends_is_counted_and_never_released(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with arena_rig(
        send_timeout=SEND_TIMEOUT,
        transfer_timeout=WAIT,
        progress_timeout=10_000.0,
        overdue_after=100.0,
    ) as (rig, arena, _):
        frozen = await rig.landing(SEGMENT, name="frozen")
        first = fill(arena, 1)
        await rig.open("r1", opener(ArenaEmbedding([first])), receive_count=1)
        rig.fabric.freeze(frozen.engine.session_id)
        with pytest.raises(EngineError):
            await rig.registry.require_live("r1").send(frozen.receiver)
        await trio.sleep(SEND_TIMEOUT + 200)
        assert rig.observer.names("transfer_hold_overdue") == [(SEGMENT,)]
        assert rig.ledger.held == 1
        assert not first[0].freed
        rig.fabric.thaw(frozen.engine.session_id)
        await trio.testing.wait_all_tasks_blocked()
        assert rig.ledger.held == 0
        assert first[0].freed


@pytest.mark.parametrize("end", ["deadline", "shutdown"])
async def test_a_submitted_transfer_is_not_awaited_past_its_requests_end(
    autojump_clock: trio.testing.MockClock, end: str
) -> None:
    """A send into a rank that froze mid-transfer answers at its request's deadline (or at a
    shutdown), not after the engine's own, longer wait: the engine stops waiting, and the
    segment the transfer may still read is held until it ends, never handed to another."""
    long_wait = 3 * SEND_TIMEOUT  # Mooncake's MC_TRANSFER_TIMEOUT, longer than the deadline
    async with arena_rig(
        send_timeout=SEND_TIMEOUT, transfer_timeout=long_wait, progress_timeout=PROGRESS
    ) as (rig, arena, _):
        frozen = await rig.landing(SEGMENT, name="frozen")
        first = fill(arena, 1)
        own = bytes(first[0].buffer)
        await rig.open("r1", opener(ArenaEmbedding([first])), receive_count=1)
        scope = rig.registry.require_live("r1")
        rig.fabric.freeze(frozen.engine.session_id)
        async with trio.open_nursery() as nursery:
            if end == "shutdown":

                async def shut_down() -> None:
                    await trio.sleep(2.0)
                    scope.cancel()

                nursery.start_soon(shut_down)
            with pytest.raises(RequestError) as failed:
                await scope.send(frozen.receiver)
        ended_at = SEND_TIMEOUT if end == "deadline" else 2.0
        assert trio.current_time() == pytest.approx(ended_at)
        assert failed.value.status == (504 if end == "deadline" else 503)
        await trio.testing.wait_all_tasks_blocked()
        assert len(rig.registry) == 0
        assert rig.ledger.held == 1, "the segment went back while the transfer may read it"

        second = fill(arena, 2)
        assert second[0].offset != first[0].offset
        rig.fabric.thaw(frozen.engine.session_id)
        assert frozen.landed(SEGMENT) == own, "the frozen rank received another request's bytes"
        await trio.testing.wait_all_tasks_blocked()
        assert rig.ledger.held == 0
        arena.release(second[0])
        assert arena.leased_bytes == 0
        assert rig.fabric.violations == []
