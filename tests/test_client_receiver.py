"""The landing pool's slot allocator and read-back (no server needed, one real engine)."""

from __future__ import annotations

import pytest
import torch

from support.engines import RankEngines
from trio_encode.client import LandingPool, PoolExhausted


async def test_slots_are_aligned_disjoint_and_reused_after_release(
    rank_engines: RankEngines,
) -> None:
    async with LandingPool.open(rank_engines.ranks[0], 4096) as pool:
        a, b = pool.allocate(100), pool.allocate(1000)
        assert a.address == pool.address
        assert b.address == pool.address + 128  # 100 rounded up to the 64-byte alignment
        with pytest.raises(PoolExhausted):
            pool.allocate(4096)
        a.release()
        b.release()
        a.release()  # twice is harmless
        assert pool.free_bytes == 4096
        assert pool.allocate(4096).address == pool.address  # neighbours merged again


async def test_a_slot_reads_back_as_the_embedding_it_holds(rank_engines: RankEngines) -> None:
    async with LandingPool.open(rank_engines.ranks[0], 1 << 16) as pool:
        expected = torch.randn(8, 16).to(torch.bfloat16)
        slot = pool.allocate(expected.numel() * 2)
        slot.raw()[:] = expected.view(-1).view(torch.uint8)
        assert torch.equal(slot.read(8, 16, "bfloat16"), expected)
        with pytest.raises(ValueError, match="does not fit"):
            slot.read(9, 16, "float32")
        slot.release()
        with pytest.raises(RuntimeError, match="released"):
            slot.raw()


async def test_a_quarantined_slot_stays_out_of_use_for_its_stale_seconds(
    rank_engines: RankEngines,
) -> None:
    """After a failed /send, bytes of that request may still land in the slot: the pool keeps
    the range out of use until ``stale_seconds`` have passed, then hands it out again."""
    now = [0.0]
    async with LandingPool.open(
        rank_engines.ranks[0], 4096, stale_seconds=30.0, clock=lambda: now[0]
    ) as pool:
        failed = pool.allocate(4096)
        failed.quarantine()
        failed.release()  # already given up: ignored
        assert (pool.free_bytes, pool.quarantined_bytes) == (0, 4096)
        now[0] = 29.9
        with pytest.raises(PoolExhausted, match="4096 quarantined"):
            pool.allocate(64)
        now[0] = 30.0
        assert pool.quarantined_bytes == 0
        assert pool.allocate(4096).address == pool.address
