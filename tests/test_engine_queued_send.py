"""A send queued behind a full per-session slot, on the real Mooncake engine.

``submitted`` is what a request scope uses to decide whether a send may already be writing
into the receiver (and so whether its memory must be held); a send still waiting for its
receiver's slot must not be counted as one, and one cancelled there must never reach Mooncake.
"""

from __future__ import annotations

from typing import Any

import torch
import trio

from trio_encode.engine import Write
from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings

SIZE = 4096


class CountingRaw:
    """A real Mooncake engine that counts the transfers submitted to it."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.submitted = 0

    def transfer_submit_write(self, *args: Any) -> int:
        self.submitted += 1
        return int(self._raw.transfer_submit_write(*args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


async def test_a_send_queued_behind_a_full_session_slot_is_not_submitted_and_can_leave(
    mooncake_engines: tuple[MooncakeEngine, MooncakeEngine],
) -> None:
    """The receiver's only slot is held (as by a stalled send): a send queued behind it is not
    marked submitted while it waits; cancelled, it raises Cancelled, Mooncake never sees it,
    and the destination bytes stay as they were. Freed, the slot serves the next send."""
    _, receiver = mooncake_engines
    created = await MooncakeEngine.create(MooncakeSettings(sends_per_session=1))
    raw = CountingRaw(created.raw)
    sender = MooncakeEngine(raw, created.settings)
    source = torch.full((SIZE,), 7, dtype=torch.uint8)
    landing = torch.zeros(2 * SIZE, dtype=torch.uint8)
    src, dst = int(source.data_ptr()), int(landing.data_ptr())
    await receiver.register(dst, 2 * SIZE)
    try:
        with trio.fail_after(20):
            # First contact made (and checked) on the second half: only the slot is in play.
            await sender.transfer(Write(receiver.session_id, [(src, SIZE)], dst + SIZE))
            assert bool((landing[SIZE:] == 7).all())
            assert raw.submitted == 1
            release = trio.Event()
            holding = trio.Event()

            async def stalled_send() -> None:
                async with sender.threads.session_slot(receiver.session_id):
                    holding.set()
                    await release.wait()

            submitted = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stalled_send)
                await holding.wait()
                with trio.CancelScope() as queued:

                    async def watch() -> None:
                        while sender.threads.sends_in_flight(receiver.session_id) < 2:  # noqa: ASYNC110
                            await trio.sleep(0.01)
                        await trio.sleep(0.2)  # queued a while: still not submitted
                        assert not submitted.is_set()
                        queued.cancel()

                    nursery.start_soon(watch)
                    await sender.transfer(
                        Write(receiver.session_id, [(src, SIZE)], dst), submitted=submitted
                    )
                    raise AssertionError("the queued send was not cancelled")
                assert queued.cancelled_caught
                release.set()
            assert not submitted.is_set()
            assert raw.submitted == 1
            assert sender.threads.sends_in_flight(receiver.session_id) == 0
            await trio.sleep(0.2)
            assert not bool(landing[:SIZE].any()), "a cancelled queued send wrote"
            # The slot free again, the same send goes through.
            await sender.transfer(Write(receiver.session_id, [(src, SIZE)], dst))
            assert bool((landing[:SIZE] == 7).all())
    finally:
        await receiver.deregister(dst)
