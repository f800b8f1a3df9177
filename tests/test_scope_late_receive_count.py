"""A receive_count that arrives after the scope opened, on the mock clock.

SGLang's tokenizer opens a request with ``/encode`` and names no count; the TP ranks' ``/send``
calls name it. The scope must then end after *all* of them (not after the first, as a default
of one would), still refuse a conflicting count, and still end at its backstop when nobody
ever names one.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from support.lifecycle_rig import Rig, lifecycle_rig
from trio_encode.errors import ReceiveCountConflict, RequestReleased, ScopeExpired
from trio_encode.request_types import Receiver, SendReport

NBYTES = 64 * 32 * 4


async def _send(rig: Rig, req_id: str, receiver: Receiver, count: int | None) -> object:
    """What the service does for a ``/send``: check (or adopt) the count, then send."""
    try:
        scope = rig.registry.require_live(req_id)
        scope.check_receive_count(count)
        return await scope.send(receiver)
    except Exception as exc:
        return exc


async def test_count_named_by_the_sends_keeps_the_scope_for_every_rank(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Opened without a count; four ranks' sends say 4: all four are served, then it ends
    (a default of one would release the scope after the first and answer the rest 410)."""
    async with lifecycle_rig(transfer_latency=0.5) as rig:
        encode, alive = rig.encoder("r1", seed=1)
        await rig.registry.open("r1", receive_count=None, encode=encode)
        scope = rig.registry.require_live("r1")
        assert scope.receive_count is None
        ranks = await rig.landings(4)
        results: list[object] = []

        async with trio.open_nursery() as nursery:
            for i, rank in enumerate(ranks):

                async def one(rank_receiver: Receiver = rank.receiver, delay: float = i) -> None:
                    await trio.sleep(delay)  # staggered: the first is done before the last comes
                    results.append(await _send(rig, "r1", rank_receiver, 4))

                nursery.start_soon(one)
        await scope.wait_ended()

        assert all(isinstance(r, SendReport) for r in results), results
        done = sorted(r.receivers_done for r in results if isinstance(r, SendReport))
        assert done == [1, 2, 3, 4]
        assert scope.end_reason == "completed"
        for rank in ranks:
            assert rank.landed(NBYTES) == rig.expected["r1"]
        assert alive() is None
        assert rig.sender.count("register") == 1
        await rig.assert_nothing_held()


async def test_sends_racing_the_encode_agree_on_the_late_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two ranks send while the encode still runs and before any count is known; the first
    names 2 and the second agrees. Both wait for the one encode, register once, and land."""
    async with lifecycle_rig() as rig:
        encode, _ = rig.encoder("r1", seed=2, latency=10.0)
        await rig.registry.open("r1", receive_count=None, encode=encode)
        ranks = await rig.landings(2)
        results: list[object] = []

        async with trio.open_nursery() as nursery:
            for rank in ranks:

                async def one(rank_receiver: Receiver = rank.receiver) -> None:
                    results.append(await _send(rig, "r1", rank_receiver, 2))

                nursery.start_soon(one)
            await trio.testing.wait_all_tasks_blocked()
            assert trio.current_time() < 10.0  # both are waiting inside the scope
            assert rig.registry.require_live("r1").receive_count == 2

        assert all(isinstance(r, SendReport) for r in results), results
        assert rig.sender.count("register") == 1
        for rank in ranks:
            assert rank.landed(NBYTES) == rig.expected["r1"]
        await rig.assert_nothing_held()


async def test_a_late_count_that_conflicts_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Once the first send has fixed the count, a sibling naming another one gets 409."""
    async with lifecycle_rig() as rig:
        encode, _ = rig.encoder("r1", seed=3)
        await rig.registry.open("r1", receive_count=None, encode=encode)
        first, second, third = await rig.landings(3)
        assert isinstance(await _send(rig, "r1", first.receiver, 2), SendReport)
        conflict = await _send(rig, "r1", second.receiver, 3)
        assert isinstance(conflict, ReceiveCountConflict)
        assert isinstance(await _send(rig, "r1", third.receiver, 2), SendReport)
        await rig.assert_nothing_held()


async def test_a_send_naming_no_count_to_a_scope_without_one_means_one_receiver(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The contract's old default still holds for clients that never name a count."""
    async with lifecycle_rig() as rig:
        encode, _ = rig.encoder("r1", seed=4)
        await rig.registry.open("r1", receive_count=None, encode=encode)
        only, late = await rig.landings(2)
        report = await _send(rig, "r1", only.receiver, None)
        assert isinstance(report, SendReport)
        assert report.receive_count == 1
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RequestReleased):
            rig.registry.require_live("r1")
        assert isinstance(await _send(rig, "r1", late.receiver, 2), RequestReleased)
        await rig.assert_nothing_held()


async def test_a_count_nobody_names_ends_at_the_backstop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 4: encoded, but no rank ever sends; the scope still ends at its deadline
    and releases everything."""
    async with lifecycle_rig(send_timeout=30.0) as rig:
        encode, alive = rig.encoder("r1", seed=5)
        await rig.registry.open("r1", receive_count=None, encode=encode)
        scope = rig.registry.require_live("r1")
        await scope.wait_encoded()
        await scope.wait_ended()
        assert trio.current_time() == pytest.approx(30.0)
        assert scope.end_reason == "expired"
        assert alive() is None
        with pytest.raises(RequestReleased):
            rig.registry.require_live("r1")
        await rig.assert_nothing_held()


async def test_expiry_message_says_the_count_was_never_named(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A pull-style waiter on a scope whose encode outlives the deadline learns why."""
    async with lifecycle_rig(send_timeout=5.0) as rig:
        encode, _ = rig.encoder("r1", seed=6, latency=60.0)
        await rig.registry.open("r1", receive_count=None, encode=encode)
        scope = rig.registry.require_live("r1")
        with pytest.raises(ScopeExpired, match="unknown number"):
            await scope.wait_encoded()
        await rig.assert_nothing_held()
