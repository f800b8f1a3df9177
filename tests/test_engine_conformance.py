"""The in-memory engine obeys Mooncake's rules: the same checks run against both engines.

Then the in-memory engine's own promises, on Trio's mock clock: virtual latency, calls that
either never start or run to completion (as a worker thread does), violation detection,
history, scripted failures and gates. Real-engine tests run on the real clock (threads).
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

import pytest
import torch
import trio
import trio.testing

from trio_encode.engine import (
    ADDRESS_OVERLAPPED,
    INVALID_ADDRESS,
    TRANSFER_FAILED,
    EngineError,
    TransferEngine,
    Write,
)
from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings
from trio_encode.testing.memory_engine import CallRecord, InMemoryEngine, InMemoryFabric

if TYPE_CHECKING:
    from conftest import BufferPool, EnginePair

KIB = 1024


def addr(tensor: torch.Tensor, offset: int = 0) -> int:
    return int(tensor.data_ptr()) + offset


async def expect_error(call: str, code: int, awaitable: Any) -> EngineError:
    with pytest.raises(EngineError) as info:
        await awaitable
    assert info.value.call == call
    assert info.value.code == code
    return info.value


async def transfer_fails(sender: TransferEngine, write: Write) -> EngineError:
    """``write`` fails as a whole, with the one code Mooncake gives any failed transfer."""
    return await expect_error("transfer", TRANSFER_FAILED, sender.transfer(write))


# -- the same rules, both engines ---------------------------------------------------------------


async def test_is_a_transfer_engine(engine_pair: EnginePair) -> None:
    assert isinstance(engine_pair.sender.engine, TransferEngine)
    host, port = engine_pair.sender.session_id.rsplit(":", 1)
    assert host
    assert int(port) > 0
    assert engine_pair.sender.session_id != engine_pair.receiver.session_id


async def test_register_and_deregister(engine_pair: EnginePair, buffers: BufferPool) -> None:
    buf = buffers.zeros(4 * KIB)
    await engine_pair.sender.register(addr(buf), 4 * KIB)
    await engine_pair.sender.deregister(addr(buf))


async def test_identical_reregister_is_overlap(
    engine_pair: EnginePair, buffers: BufferPool
) -> None:
    buf = buffers.zeros(4 * KIB)
    await engine_pair.sender.register(addr(buf), 4 * KIB)
    error = await expect_error(
        "register", ADDRESS_OVERLAPPED, engine_pair.sender.register(addr(buf), 4 * KIB)
    )
    assert error.address == addr(buf)
    assert error.length == 4 * KIB
    assert error.session_id == engine_pair.sender.session_id
    assert str(ADDRESS_OVERLAPPED) in str(error)


@pytest.mark.parametrize(
    ("offset", "length"),
    [(2 * KIB, 4 * KIB), (1 * KIB, 1 * KIB), (0, 8 * KIB)],
    ids=["straddles-end", "inside", "contains"],
)
async def test_overlapping_register_is_overlap(
    engine_pair: EnginePair, buffers: BufferPool, offset: int, length: int
) -> None:
    buf = buffers.zeros(8 * KIB)
    await engine_pair.sender.register(addr(buf), 4 * KIB)
    await expect_error(
        "register", ADDRESS_OVERLAPPED, engine_pair.sender.register(addr(buf, offset), length)
    )


async def test_adjacent_ranges_do_not_overlap(engine_pair: EnginePair, buffers: BufferPool) -> None:
    buf = buffers.zeros(8 * KIB)
    await engine_pair.sender.register(addr(buf), 4 * KIB)
    await engine_pair.sender.register(addr(buf, 4 * KIB), 4 * KIB)


async def test_deregister_unknown_start_is_invalid_address(
    engine_pair: EnginePair, buffers: BufferPool
) -> None:
    buf = buffers.zeros(4 * KIB)
    await expect_error("deregister", INVALID_ADDRESS, engine_pair.sender.deregister(addr(buf)))
    # Only the start address names a registration, not an address inside it.
    await engine_pair.sender.register(addr(buf), 4 * KIB)
    error = await expect_error(
        "deregister", INVALID_ADDRESS, engine_pair.sender.deregister(addr(buf, 16))
    )
    assert error.address == addr(buf, 16)


async def test_deregister_then_register_again(engine_pair: EnginePair, buffers: BufferPool) -> None:
    buf = buffers.zeros(4 * KIB)
    await engine_pair.sender.register(addr(buf), 4 * KIB)
    await engine_pair.sender.deregister(addr(buf))
    await engine_pair.sender.register(addr(buf), 4 * KIB)
    await expect_error("deregister", INVALID_ADDRESS, engine_pair.sender.deregister(addr(buf, 1)))


async def test_empty_register_fails(engine_pair: EnginePair, buffers: BufferPool) -> None:
    buf = buffers.zeros(16)
    await expect_error("register", TRANSFER_FAILED, engine_pair.sender.register(addr(buf), 0))


async def test_transfer_lands_every_byte(engine_pair: EnginePair, buffers: BufferPool) -> None:
    size = 256 * KIB
    source = buffers.pattern(size)
    dest = buffers.zeros(size + 2 * KIB)
    await engine_pair.sender.register(addr(source), size)
    await engine_pair.receiver.register(addr(dest), size + 2 * KIB)
    await engine_pair.sender.transfer(
        Write(engine_pair.receiver.session_id, [(addr(source), size)], addr(dest, KIB))
    )
    assert torch.equal(dest[KIB : KIB + size], source)
    assert not dest[:KIB].any()
    assert not dest[KIB + size :].any()


async def test_segments_land_back_to_back(engine_pair: EnginePair, buffers: BufferPool) -> None:
    """Three segments from different places of one registered source land contiguously."""
    source = buffers.pattern(96 * KIB)
    dest = buffers.zeros(64 * KIB)
    await engine_pair.sender.register(addr(source), 96 * KIB)
    await engine_pair.receiver.register(addr(dest), 64 * KIB)
    pieces = [(addr(source, 64 * KIB), 16 * KIB), (addr(source), 8 * KIB), (addr(source, KIB), KIB)]
    await engine_pair.sender.transfer(
        Write(engine_pair.receiver.session_id, pieces, addr(dest, KIB))
    )
    expected = torch.cat([source[64 * KIB : 80 * KIB], source[: 8 * KIB], source[KIB : 2 * KIB]])
    assert torch.equal(dest[KIB : KIB + 25 * KIB], expected)
    assert not dest[:KIB].any()
    assert not dest[26 * KIB :].any()


async def test_segments_past_the_destination_fail(
    engine_pair: EnginePair, buffers: BufferPool
) -> None:
    """A later segment that would land outside the receiver's buffer fails the whole call."""
    source = buffers.pattern(8 * KIB)
    dest = buffers.zeros(6 * KIB)
    await engine_pair.sender.register(addr(source), 8 * KIB)
    await engine_pair.receiver.register(addr(dest), 6 * KIB)
    pieces = [(addr(source), 4 * KIB), (addr(source, 4 * KIB), 4 * KIB)]
    await transfer_fails(
        engine_pair.sender, Write(engine_pair.receiver.session_id, pieces, addr(dest))
    )


async def test_transfer_to_unregistered_destination_fails(
    engine_pair: EnginePair, buffers: BufferPool
) -> None:
    source = buffers.pattern(4 * KIB)
    dest = buffers.zeros(4 * KIB)
    await engine_pair.sender.register(addr(source), 4 * KIB)
    error = await transfer_fails(
        engine_pair.sender,
        Write(engine_pair.receiver.session_id, [(addr(source), 4 * KIB)], addr(dest)),
    )
    assert error.session_id == engine_pair.receiver.session_id
    assert error.address == addr(source)
    assert error.remote_address == addr(dest)
    assert error.length == 4 * KIB
    assert not dest.any()


@pytest.mark.parametrize(
    "dest_registrations",
    [[(0, 4 * KIB)], [(0, 4 * KIB), (4 * KIB, 4 * KIB)]],
    ids=["past-the-end-of-one", "across-two-adjacent"],
)
async def test_transfer_beyond_one_registration_fails(
    engine_pair: EnginePair, buffers: BufferPool, dest_registrations: list[tuple[int, int]]
) -> None:
    """A write must land inside one registration, even where the next one starts right after."""
    source = buffers.pattern(4 * KIB)
    dest = buffers.zeros(8 * KIB)
    await engine_pair.sender.register(addr(source), 4 * KIB)
    for offset, length in dest_registrations:
        await engine_pair.receiver.register(addr(dest, offset), length)
    await transfer_fails(
        engine_pair.sender,
        Write(engine_pair.receiver.session_id, [(addr(source), 4 * KIB)], addr(dest, 2 * KIB)),
    )
    assert not dest.any()


async def test_transfer_to_dead_session_fails(engine_pair: EnginePair, buffers: BufferPool) -> None:
    source = buffers.pattern(4 * KIB)
    dest = buffers.zeros(4 * KIB)
    await engine_pair.sender.register(addr(source), 4 * KIB)
    error = await transfer_fails(
        engine_pair.sender,
        Write(engine_pair.dead_session_id, [(addr(source), 4 * KIB)], addr(dest)),
    )
    assert error.session_id == engine_pair.dead_session_id
    assert engine_pair.dead_session_id in str(error)


# -- Mooncake-specific ---------------------------------------------------------------------------


async def test_mooncake_create_names_its_session() -> None:
    engine = await MooncakeEngine.create(MooncakeSettings())
    assert engine.session_id == f"127.0.0.1:{engine.raw.get_rpc_port()}"
    assert engine.settings == MooncakeSettings()


@pytest.mark.parametrize("failure", ["module", "library"])
async def test_missing_mooncake_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    if failure == "module":
        monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # makes the import fail
    else:

        def no_library(name: str, package: str | None = None) -> Any:
            raise OSError("libibverbs.so.1: cannot open shared object file")

        monkeypatch.setattr(importlib, "import_module", no_library)
    with pytest.raises(RuntimeError, match=r"trio-encode\[mooncake\]") as info:
        await MooncakeEngine.create()
    assert "libibverbs1" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError | OSError)


# -- in-memory only: the RDMA rule -----------------------------------------------------------


async def test_memory_transfer_from_unregistered_source_fails(
    fabric: InMemoryFabric, buffers: BufferPool
) -> None:
    # Over RDMA the source must be registered; Mooncake over TCP does not check it
    # (shared/context/machine.md), so only the in-memory engine can hold code to this rule.
    sender, receiver = fabric.engine(), fabric.engine()
    source, dest = buffers.pattern(4 * KIB), buffers.zeros(4 * KIB)
    await receiver.register(addr(dest), 4 * KIB)
    await transfer_fails(sender, Write(receiver.session_id, [(addr(source), 4 * KIB)], addr(dest)))
    await sender.register(addr(source), 2 * KIB)  # part of the source is not enough
    await transfer_fails(sender, Write(receiver.session_id, [(addr(source), 4 * KIB)], addr(dest)))
    assert not dest.any()


async def test_memory_closed_receiver_is_dead(fabric: InMemoryFabric, buffers: BufferPool) -> None:
    sender, receiver = fabric.engine(), fabric.engine()
    source, dest = buffers.pattern(KIB), buffers.zeros(KIB)
    await sender.register(addr(source), KIB)
    await receiver.register(addr(dest), KIB)
    receiver.close()
    assert fabric.lookup(receiver.session_id) is None
    await transfer_fails(sender, Write(receiver.session_id, [(addr(source), KIB)], addr(dest)))
    assert not dest.any()


# -- in-memory only: virtual time and thread-like cancellation ----------------------------------


async def transfer_setup(
    fabric: InMemoryFabric, buffers: BufferPool, size: int = 4 * KIB, **latencies: float
) -> tuple[InMemoryEngine, InMemoryEngine, torch.Tensor, torch.Tensor]:
    sender, receiver = fabric.engine("sender", **latencies), fabric.engine("receiver")
    source, dest = buffers.pattern(size), buffers.zeros(size)
    await sender.register(addr(source), size)
    await receiver.register(addr(dest), size)
    return sender, receiver, source, dest


async def test_memory_latency_takes_virtual_time(
    autojump_clock: trio.testing.MockClock, fabric: InMemoryFabric, buffers: BufferPool
) -> None:
    sender, receiver, source, dest = await transfer_setup(
        fabric, buffers, register_latency=1.0, transfer_latency=3.0
    )
    start = trio.current_time()
    await sender.transfer(Write(receiver.session_id, [(addr(source), 4 * KIB)], addr(dest)))
    assert trio.current_time() - start == 3.0
    assert torch.equal(source, dest)
    record = sender.history[-1]
    assert record.end is not None
    assert record.end - record.start == 3.0
    assert sender.history[0].end == sender.history[0].start + 1.0


async def test_memory_scripted_latencies(
    autojump_clock: trio.testing.MockClock, fabric: InMemoryFabric, buffers: BufferPool
) -> None:
    sender, receiver, source, dest = await transfer_setup(fabric, buffers, transfer_latency=1.0)

    async def timed_transfer() -> float:
        start = trio.current_time()
        await sender.transfer(Write(receiver.session_id, [(addr(source), 4 * KIB)], addr(dest)))
        return trio.current_time() - start

    sender.script_latency("transfer", [5.0, 0.5])
    assert [await timed_transfer() for _ in range(3)] == [5.0, 0.5, 1.0]

    def by_length(call: CallRecord) -> float:
        return (call.length or 0) / KIB

    sender.script_latency("transfer", by_length)
    assert await timed_transfer() == 4.0
    sender.script_latency("transfer", None)
    assert await timed_transfer() == 1.0


async def test_memory_cancelled_caller_never_starts_the_call(
    autojump_clock: trio.testing.MockClock, fabric: InMemoryFabric, buffers: BufferPool
) -> None:
    engine = fabric.engine(register_latency=1.0)
    buf = buffers.zeros(KIB)
    with trio.CancelScope() as scope:
        scope.cancel()
        await engine.register(addr(buf), KIB)
    assert scope.cancelled_caught
    assert engine.history == []
    assert engine.live_registrations == {}
    assert trio.current_time() == 0.0


async def test_memory_started_call_completes_when_caller_is_cancelled(
    autojump_clock: trio.testing.MockClock, fabric: InMemoryFabric, buffers: BufferPool
) -> None:
    sender, receiver, source, dest = await transfer_setup(fabric, buffers, transfer_latency=5.0)
    start = trio.current_time()
    with trio.move_on_after(1.0):
        await sender.transfer(Write(receiver.session_id, [(addr(source), 4 * KIB)], addr(dest)))
        # Like to_thread.run_sync: the result comes back; the cancellation waits for the
        # caller's next checkpoint.
        with pytest.raises(trio.Cancelled):
            await trio.lowlevel.checkpoint()
    assert trio.current_time() - start == 5.0
    assert torch.equal(source, dest)
    assert sender.history[-1].ok


@pytest.mark.parametrize(("side", "what"), [("source", "reads from"), ("dest", "writes into")])
async def test_memory_deregister_during_transfer_is_a_violation(
    autojump_clock: trio.testing.MockClock,
    fabric: InMemoryFabric,
    buffers: BufferPool,
    side: str,
    what: str,
) -> None:
    """Mooncake lets either end deregister under a running transfer; the in-memory engine
    records it as a violation of the side that did (a new registration is not the old one)."""
    sender, receiver, source, dest = await transfer_setup(fabric, buffers, transfer_latency=5.0)
    owner, memory = (sender, source) if side == "source" else (receiver, dest)
    async with trio.open_nursery() as nursery:

        async def transfer() -> None:
            await transfer_fails(
                sender, Write(receiver.session_id, [(addr(source), 4 * KIB)], addr(dest))
            )

        nursery.start_soon(transfer)
        await trio.sleep(1.0)
        assert len(sender.in_flight) == 1
        await owner.deregister(addr(memory))
        await owner.register(addr(memory), 4 * KIB)
    assert len(owner.violations) == 1
    assert what in owner.violations[0]
    assert fabric.violations == owner.violations
    assert not dest.any()


async def test_memory_deregister_after_transfer_is_clean(
    autojump_clock: trio.testing.MockClock, fabric: InMemoryFabric, buffers: BufferPool
) -> None:
    sender, receiver, source, dest = await transfer_setup(fabric, buffers, transfer_latency=5.0)
    await sender.transfer(Write(receiver.session_id, [(addr(source), 4 * KIB)], addr(dest)))
    await sender.deregister(addr(source))
    await receiver.deregister(addr(dest))
    assert fabric.violations == []
    assert torch.equal(source, dest)


async def test_memory_history_and_counts(
    autojump_clock: trio.testing.MockClock, fabric: InMemoryFabric, buffers: BufferPool
) -> None:
    engine = fabric.engine(register_latency=1.0, deregister_latency=2.0)
    buf = buffers.zeros(2 * KIB)
    await engine.register(addr(buf), KIB)
    await engine.register(addr(buf, KIB), KIB)
    assert engine.live_registrations == {addr(buf): KIB, addr(buf, KIB): KIB}
    await expect_error("register", ADDRESS_OVERLAPPED, engine.register(addr(buf), KIB))
    await engine.deregister(addr(buf))
    assert engine.live_registrations == {addr(buf, KIB): KIB}
    assert [(c.kind, c.code, c.start, c.end) for c in engine.history] == [
        ("register", 0, 0.0, 1.0),
        ("register", 0, 1.0, 2.0),
        ("register", ADDRESS_OVERLAPPED, 2.0, 3.0),
        ("deregister", 0, 3.0, 5.0),
    ]
    assert engine.history[2].address == addr(buf)
    assert engine.history[2].length == KIB
    assert engine.history[2].session_id == engine.session_id
    assert engine.count("register") == 3
    assert engine.count("register", ok=True) == 2
    assert engine.count("register", ok=False) == 1
    assert engine.count("deregister") == 1
    assert engine.in_flight == []


async def test_memory_fail_next(
    autojump_clock: trio.testing.MockClock, fabric: InMemoryFabric, buffers: BufferPool
) -> None:
    sender, receiver, source, dest = await transfer_setup(
        fabric, buffers, register_latency=1.0, transfer_latency=2.0
    )
    sender.fail_next("register", code=TRANSFER_FAILED)
    other = buffers.zeros(KIB)
    start = trio.current_time()
    await expect_error("register", TRANSFER_FAILED, sender.register(addr(other), KIB))
    assert trio.current_time() - start == 1.0  # after its latency
    assert addr(other) not in sender.live_registrations  # without effect
    await sender.register(addr(other), KIB)  # only the next call failed

    sender.fail_next("transfer", code=-5, times=2)
    for _ in range(2):
        await expect_error(
            "transfer",
            -5,
            sender.transfer(Write(receiver.session_id, [(addr(source), 4 * KIB)], addr(dest))),
        )
    assert not dest.any()
    await sender.transfer(Write(receiver.session_id, [(addr(source), 4 * KIB)], addr(dest)))
    assert torch.equal(source, dest)

    sender.fail_next("deregister", code=INVALID_ADDRESS)
    await expect_error("deregister", INVALID_ADDRESS, sender.deregister(addr(other)))
    assert addr(other) in sender.live_registrations
    with pytest.raises(ValueError, match="non-zero"):
        sender.fail_next("register", code=0)


async def test_memory_gate_holds_calls_until_opened(
    autojump_clock: trio.testing.MockClock, fabric: InMemoryFabric, buffers: BufferPool
) -> None:
    sender, receiver, source, dest = await transfer_setup(fabric, buffers)
    gate = sender.gate("transfer")
    callers = [trio.CancelScope() for _ in range(2)]

    async def held_transfer(caller: trio.CancelScope) -> None:
        with caller:
            await sender.transfer(Write(receiver.session_id, [(addr(source), 4 * KIB)], addr(dest)))

    async with trio.open_nursery() as nursery:
        for caller in callers:
            nursery.start_soon(held_transfer, caller)
        await gate.wait_arrivals(2)
        assert gate.entered.is_set()
        assert gate.waiting == 2
        assert [c.kind for c in sender.in_flight] == ["transfer", "transfer"]
        await trio.sleep(100.0)
        assert not dest.any()  # held: nothing landed
        # A held call is a running thread: cancelling its caller does not free it.
        for caller in callers:
            caller.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert len(sender.in_flight) == 2
        gate.open()
    assert gate.waiting == 0
    assert sender.in_flight == []
    assert [c.ok for c in sender.calls("transfer")] == [True, True]
    assert torch.equal(source, dest)
    # An opened gate lets later calls straight through.
    await sender.transfer(Write(receiver.session_id, [(addr(source), 4 * KIB)], addr(dest)))
