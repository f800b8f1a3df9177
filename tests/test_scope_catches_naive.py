"""The invariant tests' scenarios, run against the real scope and a naive one.

The naive scope (per-send register / transfer / deregister / null, as SGLang had it) must fail
them with exactly the errors SGLang's users saw; the real scope must pass. This shows the
scenarios force the interleavings they claim to, rather than passing by luck.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from support.lifecycle_rig import Landing, Rig, lifecycle_rig, make_embedding
from support.naive_scope import EmbeddingGone, NaiveScope
from trio_encode.engine import ADDRESS_OVERLAPPED, EngineError
from trio_encode.request_types import Receiver

Send = Callable[[Receiver], Awaitable[object]]


async def scope_under_test(rig: Rig, kind: str, receive_count: int) -> Send:
    """A ``send`` callable for one request, from the real scope or the naive one."""
    if kind == "naive":
        return NaiveScope(rig.sender, make_embedding(1)).send
    encode, _ = rig.encoder("r1", seed=1)
    await rig.open("r1", encode, receive_count=receive_count)
    return rig.registry.require_live("r1").send


async def outcomes_of(sends: list[Callable[[], Awaitable[object]]]) -> list[object]:
    results: list[object] = [None] * len(sends)

    async def one(i: int) -> None:
        try:
            results[i] = await sends[i]()
        except Exception as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        for i in range(len(sends)):
            nursery.start_soon(one, i)
    return results


async def concurrent_siblings(kind: str) -> tuple[list[object], list[Landing], Rig]:
    """Story 1: four siblings send while the first registration is still running."""
    async with lifecycle_rig(register_latency=1.0) as rig:
        send = await scope_under_test(rig, kind, receive_count=4)
        ranks = await rig.landings(4)
        results = await outcomes_of([lambda r=r: send(r.receiver) for r in ranks])
        await trio.testing.wait_all_tasks_blocked()
        return results, ranks, rig


async def staggered_siblings(kind: str) -> tuple[list[object], list[Landing], Rig]:
    """Story 2: one sibling finishes before the next arrives (TP ranks are never in step)."""
    async with lifecycle_rig() as rig:
        send = await scope_under_test(rig, kind, receive_count=2)
        first, second = await rig.landings(2)
        results = [await send(first.receiver)]
        await trio.sleep(0.5)
        try:
            results.append(await send(second.receiver))
        except Exception as exc:
            results.append(exc)
        await trio.testing.wait_all_tasks_blocked()
        return results, [first, second], rig


async def test_naive_scope_fails_the_sibling_race_with_overlap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    results, _, _ = await concurrent_siblings("naive")
    overlaps = [r for r in results if isinstance(r, EngineError) and r.call == "register"]
    assert overlaps, results
    assert all(r.code == ADDRESS_OVERLAPPED for r in overlaps)
    assert "code -7" in str(overlaps[0])


async def test_naive_scope_fails_staggered_siblings_with_early_none(
    autojump_clock: trio.testing.MockClock,
) -> None:
    results, _, _ = await staggered_siblings("naive")
    assert isinstance(results[1], EmbeddingGone)
    assert "None" in str(results[1])


@pytest.mark.parametrize("scenario", [concurrent_siblings, staggered_siblings])
async def test_real_scope_passes_the_same_scenarios(
    autojump_clock: trio.testing.MockClock,
    scenario: Callable[[str], Awaitable[tuple[list[object], list[Landing], Rig]]],
) -> None:
    results, ranks, rig = await scenario("real")
    assert not any(isinstance(r, Exception) for r in results), results
    for rank in ranks:
        assert rank.landed(len(rig.expected["r1"])) == rig.expected["r1"]
    assert rig.sender.count("register") == 1
    assert rig.sender.count("deregister") == 1
    assert rig.fabric.violations == []
