"""A short sample of ``trio-encode soak``: a few hundred requests against a real server with
every kind of fault, all checks as in the full soak (``nox -s soak``)."""

from __future__ import annotations

import torch
import trio

from support.engines import RankEngines
from trio_encode.encoder import EncoderSettings
from trio_encode.tools.soak.drill import Rank
from trio_encode.tools.soak.receiver import open_receiver
from trio_encode.tools.soak.run import SoakConfig, run_soak

TINY = EncoderSettings(
    image_size=32,
    patch_size=16,
    width=32,
    depth=1,
    heads=1,
    hidden_size=1024,
    torch_threads=1,
    cache_bytes=1 << 20,
)


async def test_a_short_soak_with_every_fault_keeps_every_promise() -> None:
    config = SoakConfig(
        requests=240,
        warmup=40,
        images=24,
        concurrency=8,
        send_timeout=4.0,
        freeze_seconds=4.0,
        first_contact_freeze=4.0,
        vanish_rate=0.03,
        engine_faults="register=0.01,transfer=0.01,seed=3",
        encoder=TINY,
    )
    result = await run_soak(config)
    assert result.ok, result.table()
    assert result.counts.requests_done == 240
    counts = result.counts
    assert counts.vanished_mid_body > 0
    assert counts.vanished_after_encode > 0
    assert counts.vanished_mid_send > 0
    assert result.statuses["/send"]["200"] > 700
    assert result.statuses["/send"].get("502", 0) > 0  # injected, frozen and killed ranks
    assert result.checked_bytes >= 700 * 4 * 1024 * 4
    assert result.probe_frozen_count > 0
    assert result.backstop_expiries > 0  # ranks that vanished after /encode
    assert (result.left_scopes, result.left_registrations) == (0, 0)
    assert result.late_freeze_window is not None  # a rank resumed after its deadline
    assert result.counts.foreign_slots == 0
    assert 0 < result.probe_first_contact_max < 2.0  # probes ran, none stalled


async def test_a_byte_landing_in_a_slot_between_its_requests_is_caught(
    rank_engines: RankEngines,
) -> None:
    """The soak's foreign-byte check, against a real receiver: a slot whose request ended is
    filled with the marker; a write that lands before its next request uses it (a transfer
    the server let outlive its request) makes :meth:`Rank.clean` refuse it."""
    stale = torch.full((64,), 7, dtype=torch.uint8)
    async with open_receiver(4096, "rank") as receiver:
        rank = Rank(receiver, 4096, 4096, quiet_seconds=0.0, dirty_seconds=0.0)
        async with trio.open_nursery() as nursery, rank.slot(nursery) as slot:
            assert await rank.clean(slot)  # never used: nothing to compare with
            slot.dirty = True  # its send failed; it rests, then is filled
        async with trio.open_nursery() as nursery, rank.slot(nursery) as slot:
            assert await rank.clean(slot)
        await rank_engines.server.transfer(
            receiver.session_id, [(int(stale.data_ptr()), 64)], slot.address
        )
        async with trio.open_nursery() as nursery, rank.slot(nursery) as again:
            assert again is slot
            assert not await rank.clean(again)
