"""The cost model in the in-memory engine, and the modelled RDMA run built on it.

Both run in virtual time, so their numbers are exact and the tests can state them.
"""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from trio_encode.engine import Write
from trio_encode.testing.costs import RDMA, CallCost, CostModel
from trio_encode.testing.memory_engine import InMemoryFabric
from trio_encode.tools.bench.rdma_model import PATHS, run_model

FLAT = CostModel(
    name="flat",
    register=CallCost(fixed=1e-3, per_byte=1e-9),
    deregister=CallCost(fixed=0.5e-3, per_byte=0.0),
    transfer=CallCost(fixed=0.0, per_byte=1e-9),
    sources=("round numbers for a test",),
)


async def test_calls_take_the_modelled_time(autojump_clock: trio.testing.MockClock) -> None:
    fabric = InMemoryFabric()
    sender, receiver = fabric.engine("s"), fabric.engine("r")
    sender.apply_costs(FLAT)
    source = torch.ones(1_000_000, dtype=torch.uint8)
    dest = torch.zeros(1_000_000, dtype=torch.uint8)
    await receiver.register(int(dest.data_ptr()), dest.numel())

    start = trio.current_time()
    await sender.register(int(source.data_ptr()), source.numel())
    assert trio.current_time() - start == pytest.approx(2e-3)  # 1 ms + 1 MB x 1 ns
    start = trio.current_time()
    await sender.transfer(
        Write(receiver.session_id, [(int(source.data_ptr()), 10**6)], int(dest.data_ptr()))
    )
    assert trio.current_time() - start == pytest.approx(1e-3)
    assert bool(dest.all())
    start = trio.current_time()
    await sender.deregister(int(source.data_ptr()))
    assert trio.current_time() - start == pytest.approx(0.5e-3)


async def test_transfers_from_one_engine_share_its_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two 1 MB transfers at once take as long as 2 MB: the link's bandwidth is shared."""
    fabric = InMemoryFabric()
    sender = fabric.engine("s")
    sender.apply_costs(FLAT)
    source = torch.ones(1_000_000, dtype=torch.uint8)
    await sender.register(int(source.data_ptr()), source.numel())
    ranks = [fabric.engine(f"r{i}") for i in range(2)]
    buffers = [torch.zeros(1_000_000, dtype=torch.uint8) for _ in ranks]
    for rank, buffer in zip(ranks, buffers, strict=True):
        await rank.register(int(buffer.data_ptr()), buffer.numel())
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for rank, buffer in zip(ranks, buffers, strict=True):
            write = Write(
                rank.session_id, [(int(source.data_ptr()), 10**6)], int(buffer.data_ptr())
            )
            nursery.start_soon(sender.transfer, write)
    assert trio.current_time() - start == pytest.approx(2e-3)


def test_the_modelled_run_registers_nothing_per_request_with_the_arena() -> None:
    result = run_model(RDMA, [1_000_000], [1, 4], requests=8)
    by_path = {(row.path, row.tp): row for row in result.rows}
    for tp in (1, 4):
        arena, plain = by_path[PATHS[0], tp], by_path[PATHS[1], tp]
        assert arena.registrations == 0
        assert arena.register_seconds == 0
        assert plain.registrations == 8
        assert plain.register_seconds == pytest.approx(
            8 * (RDMA.register.seconds(10**6) + RDMA.deregister.seconds(10**6))
        )
        assert arena.requests_per_second > plain.requests_per_second
    # One rank: registration sits on every request's critical path.
    assert by_path[PATHS[0], 1].requests_per_second > 2 * by_path[PATHS[1], 1].requests_per_second


def test_the_modelled_table_says_it_is_a_model_and_cites_its_figures() -> None:
    text = run_model(RDMA, [1_000_000], [1], requests=2).table()
    assert text.startswith("MODEL, not a measurement")
    assert "pull request 855" in text
