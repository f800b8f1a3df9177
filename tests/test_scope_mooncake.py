"""Request scopes over the real Mooncake engine (TCP on loopback), every byte checked.

Each receiver owns its own engine and registered landing buffer, as a prefill rank does.
Real engines run their calls in worker threads, so these tests run on the real clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import torch
import trio

from trio_encode.embedding import Embedding
from trio_encode.engine import TransferEngine, Write
from trio_encode.engine.mooncake import MooncakeEngine
from trio_encode.ledger import RegistrationLedger
from trio_encode.request_types import EmbeddingMemory, Encode, Receiver, SendReport
from trio_encode.scopes import ScopeRegistry
from trio_encode.testing.forwarding import ForwardingEngine

MIB = 1 << 20


class CountingEngine(ForwardingEngine):
    """Forwards to a real engine and counts the calls the lifecycle makes."""

    def __init__(self, engine: TransferEngine) -> None:
        super().__init__(engine)
        self.calls = {"register": 0, "deregister": 0, "transfer": 0}

    async def register(self, address: int, length: int) -> None:
        self.calls["register"] += 1
        await super().register(address, length)

    async def deregister(self, address: int) -> None:
        self.calls["deregister"] += 1
        await super().deregister(address)

    async def transfer(self, write: Write, *, submitted: trio.Event | None = None) -> None:
        self.calls["transfer"] += 1
        await super().transfer(write, submitted=submitted)


@dataclass
class RealRank:
    engine: MooncakeEngine
    buffer: torch.Tensor

    @property
    def receiver(self) -> Receiver:
        return Receiver(self.engine.session_id, int(self.buffer.data_ptr()))


@pytest.fixture
async def ranks() -> AsyncIterator[list[RealRank]]:
    """Four prefill ranks, each with its own Mooncake engine and a registered 8 MiB buffer."""
    made = []
    for _ in range(4):
        engine = await MooncakeEngine.create()
        buffer = torch.zeros(8 * MIB, dtype=torch.uint8)
        await engine.register(int(buffer.data_ptr()), buffer.numel())
        made.append(RealRank(engine, buffer))
    yield made
    for rank in made:
        await rank.engine.deregister(int(rank.buffer.data_ptr()))


def returning(embedding: Embedding) -> Encode:
    box = [embedding]

    async def encode() -> EmbeddingMemory:
        return box.pop()

    return encode


async def test_four_concurrent_siblings_over_real_mooncake(ranks: list[RealRank]) -> None:
    sender = CountingEngine(await MooncakeEngine.create())
    ledger = RegistrationLedger(sender)
    embedding = Embedding(torch.randn(1536, 1024, generator=torch.Generator().manual_seed(7)))
    expected = embedding.tensor.view(torch.uint8).flatten().clone()
    assert embedding.nbytes == 6 * MIB

    async with trio.open_nursery() as nursery:
        registry = ScopeRegistry(nursery, engine=sender, ledger=ledger, send_timeout=60)
        await registry.open("r1", receive_count=4, encode=returning(embedding))
        del embedding
        scope = registry.require_live("r1")
        reports: list[SendReport] = []

        async def send(rank: RealRank) -> None:
            reports.append(await scope.send(rank.receiver))

        with trio.fail_after(30):
            async with trio.open_nursery() as senders:
                for rank in ranks:
                    senders.start_soon(send, rank)
            await scope.wait_ended()

    assert sorted(r.receivers_done for r in reports) == [1, 2, 3, 4]
    for rank in ranks:
        assert torch.equal(rank.buffer[: expected.numel()], expected)
    assert sender.calls == {"register": 1, "deregister": 1, "transfer": 4}
    assert ledger.live_registrations == 0
    assert scope.end_reason == "completed"


async def test_two_requests_sharing_one_tensor_over_real_mooncake(
    ranks: list[RealRank],
) -> None:
    """Invariant 1 on the real engine: a cache hit gives two req_ids the same tensor; the real
    engine would answer a second registration with -7, so there must be only one."""
    sender = CountingEngine(await MooncakeEngine.create())
    ledger = RegistrationLedger(sender)
    shared = Embedding(torch.randn(512, 1024, generator=torch.Generator().manual_seed(8)))
    expected = shared.tensor.view(torch.uint8).flatten().clone()

    async with trio.open_nursery() as nursery:
        registry = ScopeRegistry(nursery, engine=sender, ledger=ledger, send_timeout=60)
        await registry.open("a", receive_count=2, encode=returning(shared))
        await registry.open("b", receive_count=2, encode=returning(shared))
        del shared
        a, b = registry.require_live("a"), registry.require_live("b")
        with trio.fail_after(30):
            async with trio.open_nursery() as senders:
                senders.start_soon(a.send, ranks[0].receiver)
                senders.start_soon(b.send, ranks[1].receiver)
                senders.start_soon(a.send, ranks[2].receiver)
                senders.start_soon(b.send, ranks[3].receiver)
            await a.wait_ended()
            await b.wait_ended()

    for rank in ranks:
        assert torch.equal(rank.buffer[: expected.numel()], expected)
    assert sender.calls["register"] == 1
    assert sender.calls["deregister"] == 1
    assert ledger.live_registrations == 0
