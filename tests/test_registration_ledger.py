"""The ledger's waits for a region that is changing state, on the in-memory engine.

A lease is only good on a region that the engine holds: one still being registered may yet be
refused, and one being deregistered is about to vanish. So a second request that shares the
memory (an embedding-cache hit) waits for the region to settle, then leases the registered
region or registers the memory afresh.
"""

from __future__ import annotations

import torch
import trio
import trio.testing

from trio_encode.ledger import Lease, RegistrationLedger
from trio_encode.testing.memory_engine import InMemoryFabric

NBYTES = 4096


class TaskSteps(trio.abc.Instrument):
    """Counts the steps one task takes (a waiting task takes one; a spinning one, many)."""

    def __init__(self) -> None:
        self.task: trio.lowlevel.Task | None = None
        self.steps = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


async def test_lease_waits_for_a_region_still_registering(
    autojump_clock: trio.testing.MockClock, fabric: InMemoryFabric
) -> None:
    """A lease asked for while the region's registration runs is granted only once the
    engine has registered it, and shares that one registration."""
    engine = fabric.engine("encoder", register_latency=1.0)
    ledger = RegistrationLedger(engine)
    memory = torch.zeros(NBYTES, dtype=torch.uint8)
    address = int(memory.data_ptr())
    leases: dict[str, Lease] = {}
    granted: dict[str, float] = {}

    async def lease(name: str) -> None:
        leases[name] = await ledger.acquire(address, NBYTES)
        granted[name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lease, "first")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(lease, "second")
    (register,) = engine.calls("register")
    assert register.end is not None
    assert granted["second"] >= register.end
    assert ledger.regions() == [(address, NBYTES, 2)]

    await ledger.release(leases["first"])
    assert engine.live_registrations == {address: NBYTES}  # the second lease still holds it
    await ledger.release(leases["second"])
    assert engine.live_registrations == {}
    assert engine.count("deregister", ok=True) == 1


async def _lease_during_deregistration(
    fabric: InMemoryFabric, steps: TaskSteps | None = None
) -> None:
    engine = fabric.engine("encoder")
    ledger = RegistrationLedger(engine)
    memory = torch.zeros(NBYTES, dtype=torch.uint8)
    address = int(memory.data_ptr())
    first = await ledger.acquire(address, NBYTES)
    gate = engine.gate("deregister")
    second: list[Lease] = []

    async def lease_again() -> None:
        if steps is not None:
            steps.task = trio.lowlevel.current_task()
        second.append(await ledger.acquire(address, NBYTES))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ledger.release, first)
        await gate.wait_arrivals(1)
        nursery.start_soon(lease_again)
        try:
            # Plain checkpoints, not the clock: a lease that spins never lets the clock move.
            for _ in range(50):
                await trio.lowlevel.checkpoint()
            assert second == []  # still waiting: the region is on its way out
        finally:
            gate.open()
    (lease,) = second
    # The region was registered afresh, after the old registration was gone.
    assert engine.count("register", ok=True) == 2
    assert engine.count("register", ok=False) == 0
    assert engine.live_registrations == {address: NBYTES}
    assert ledger.regions() == [(address, NBYTES, 1)]
    await ledger.release(lease)
    assert engine.live_registrations == {}


async def test_lease_waits_for_a_region_being_deregistered(
    autojump_clock: trio.testing.MockClock, fabric: InMemoryFabric
) -> None:
    """A lease asked for while the region's last lease deregisters it does not join the
    dying region: it waits, then registers the memory again."""
    await _lease_during_deregistration(fabric)


async def test_lease_waiting_for_a_deregistration_blocks(
    autojump_clock: trio.testing.MockClock, fabric: InMemoryFabric
) -> None:
    """That wait blocks, rather than looping over checkpoints until the engine answers (a busy
    event loop, and on the mock clock a hang)."""
    steps = TaskSteps()
    trio.lowlevel.add_instrument(steps)
    try:
        await _lease_during_deregistration(fabric, steps)
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert steps.steps <= 4


async def test_a_leases_repr_names_its_range_never_its_owner(fabric: InMemoryFabric) -> None:
    """A lease shows up in logs and tracebacks; printing it must not print the embedding
    its region keeps alive."""

    class Embedding:
        def __repr__(self) -> str:
            return "EMBEDDING-BYTES"

    ledger = RegistrationLedger(fabric.engine("encoder"))
    memory = torch.zeros(NBYTES, dtype=torch.uint8)
    lease = await ledger.acquire(int(memory.data_ptr()), NBYTES, owner=Embedding())
    assert f"address={int(memory.data_ptr())}" in repr(lease)
    assert "EMBEDDING-BYTES" not in repr(lease)
    await ledger.release(lease)
