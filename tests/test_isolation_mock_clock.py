"""No receiver slows another, however many sends it holds: on the mock clock, with the default
bounds of the engines.

A transfer holds a thread only while it submits; a send parked on a frozen receiver holds its
receiver's and host's slots and a share of the engine's transfers in flight, never the threads
another receiver's send needs. Once, two frozen TP=4 nodes with 8 sends per rank held all 32
transfer threads, and a healthy node's send waited the whole 30 s transfer timeout.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from support.lifecycle_rig import lifecycle_rig
from trio_encode.engine import TRANSFER_FAILED, EngineError
from trio_encode.engine.threads import ThreadSettings

TP = 4
NODES = 25
"""25 frozen TP=4 nodes: 100 frozen receivers."""
NBYTES = 64 * 32 * 4
"""The embedding the rig's encoders make."""
SENDS_PER_RANK = 4
"""With the default bounds (16 per host): every node holds its host's full share."""


async def test_a_hundred_frozen_receivers_never_delay_a_healthy_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    defaults = ThreadSettings()
    frozen_sends = NODES * TP * SENDS_PER_RANK
    assert frozen_sends > defaults.transfer_threads  # once, this many threads were held
    async with lifecycle_rig(threads=defaults) as rig:
        nodes = [[await rig.landing(name=f"node-{n}") for _ in range(TP)] for n in range(NODES)]
        healthy = await rig.landing(name="healthy-node")
        for rank in (rank for node in nodes for rank in node):
            rig.fabric.freeze(rank.engine.session_id)
        answers: list[BaseException | None] = []

        async def stuck(i: int, rank_index: int) -> None:
            node, rank = divmod(rank_index, TP)
            req_id = f"stuck{i}"
            encode, _ = rig.encoder(req_id, seed=100 + i)
            await rig.open(req_id, encode)
            try:
                await rig.registry.require_live(req_id).send(nodes[node][rank].receiver)
            except EngineError as exc:
                answers.append(exc)
            else:
                answers.append(None)

        async with trio.open_nursery() as nursery:
            for i in range(frozen_sends):
                nursery.start_soon(stuck, i, i % (NODES * TP))
            await trio.sleep(1)
            assert len(rig.sender.in_flight) == frozen_sends  # all submitted, all parked
            assert rig.sender.threads.transfers.borrowed_tokens == 0

            encode, alive = rig.encoder("other", seed=7)
            await rig.open("other", encode)
            other = rig.registry.require_live("other")
            began = trio.current_time()
            await other.send(healthy.receiver)
            assert trio.current_time() - began < 0.001, "the healthy receiver's send waited"
            assert healthy.landed(NBYTES) == rig.expected["other"]
            await other.wait_ended()
            assert alive() is None
        assert len(answers) == frozen_sends
        assert all(isinstance(a, EngineError) and a.code == TRANSFER_FAILED for a in answers)
        await trio.sleep(180)  # the stuck requests' backstops
        await rig.assert_nothing_held()
        assert rig.sender.threads.bounds_held == 0


async def test_the_engine_bounds_transfers_in_flight_on_the_mock_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine-wide cap: with room for 8, sends to 12 frozen receivers on 12 hosts put 8 in
    flight; the others wait for a slot (nothing submitted) and go once the first fail."""
    threads = ThreadSettings(transfers_in_flight=8)
    async with lifecycle_rig(threads=threads) as rig:
        ranks = [await rig.landing(name=f"host-{h}") for h in range(12)]
        for rank in ranks:
            rig.fabric.freeze(rank.engine.session_id)

        async def stuck(i: int) -> None:
            encode, _ = rig.encoder(f"stuck{i}", seed=100 + i)
            await rig.open(f"stuck{i}", encode)
            with pytest.raises(EngineError):
                await rig.registry.require_live(f"stuck{i}").send(ranks[i].receiver)

        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(stuck, i)
            await trio.sleep(1)
            assert len(rig.sender.in_flight) == 8
            assert rig.sender.count("transfer") == 8
            assert rig.sender.threads.in_flight.statistics().tasks_waiting == 4
            await trio.sleep(rig.fabric.transfer_timeout)
            assert rig.sender.count("transfer") == 12
        await trio.sleep(180)
        await rig.assert_nothing_held()
