"""A transfer the engine stopped waiting for, over real Mooncake into a paused (SIGSTOP) rank.

Measured on Mooncake 0.3.13: a transfer into a paused peer outlives its caller's wait and reads
its source again when the peer resumes. The request's arena segment must stay out of reuse
until Mooncake reports the transfer ended, or the rank receives the next request's bytes.
"""

from __future__ import annotations

import pytest
import torch
import trio
import xxhash

from trio_encode.arena import Arena, Segment
from trio_encode.embedding import ArenaEmbedding
from trio_encode.engine import EngineError, Write
from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings
from trio_encode.ledger import RegistrationLedger
from trio_encode.request_types import EmbeddingMemory, Receiver
from trio_encode.scopes import ScopeRegistry
from trio_encode.tools.soak.receiver import open_receiver

MIB = 1 << 20
SIZE = 32 * MIB
"""Far more than the kernel's socket buffers hold: the paused rank stalls the transfer."""
SEND_TIMEOUT = 8.0
PROGRESS = 30
"""Mooncake's progress timeout: longer than the test, so the transfer ends by landing."""


def filled(arena: Arena, value: int) -> tuple[Segment, torch.Tensor]:
    segment = arena.allocate(SIZE)
    assert segment is not None
    torch.frombuffer(segment.buffer, dtype=torch.uint8).fill_(value)
    return segment, torch.frombuffer(segment.buffer, dtype=torch.float32).view(1, SIZE // 4)


async def test_a_paused_rank_receives_its_own_bytes_when_it_resumes_never_the_next_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")  # the engine waits 5 s (Mooncake's floor)
    with trio.fail_after(120):
        async with open_receiver(SIZE, "paused") as rank, trio.open_nursery() as nursery:
            engine = await MooncakeEngine.create(MooncakeSettings(progress_timeout=PROGRESS))
            ledger = RegistrationLedger(engine, overdue_after=60)
            await nursery.start(ledger.run)
            arena = Arena(2 * SIZE, cache_bytes=0)
            await ledger.acquire(arena.address, arena.nbytes, owner=arena)
            registry = ScopeRegistry(nursery, engine=engine, ledger=ledger, send_timeout=8)
            receiver = Receiver(rank.session_id, rank.address)
            await engine.transfer(Write(rank.session_id, [(arena.address, 4096)], rank.address))

            first = filled(arena, 1)
            own = xxhash.xxh3_64_intdigest(bytes(first[0].buffer))
            embedding: list[EmbeddingMemory] = [ArenaEmbedding([first])]

            async def encode() -> EmbeddingMemory:
                return embedding.pop()

            await registry.open("r1", receive_count=1, encode=encode)
            scope = registry.require_live("r1")
            rank.freeze()
            with pytest.raises(EngineError):
                await scope.send(receiver)
            await scope.wait_ended()
            second = filled(arena, 2)  # the next request's embedding
            rank.thaw()
            await engine.settled(first[0].address, SIZE)  # Mooncake reports the transfer ended
            assert await rank.check(0, SIZE, [own], SIZE) == [True], (
                "the paused rank received bytes that are not its request's"
            )
            assert second[0].offset != first[0].offset
            while ledger.held:  # noqa: ASYNC110 (its task polls the engine; nothing to wait on)
                await trio.sleep(0.05)
            assert first[0].freed
            nursery.cancel_scope.cancel()


async def test_a_cancelled_caller_stops_waiting_for_a_paused_rank_and_its_memory_is_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller whose deadline comes while its transfer hangs in a paused rank gets its
    cancellation within a poll's pause, not after Mooncake's own wait (5 s at least); the
    source stays :meth:`reading` until Mooncake reports the transfer ended."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")  # the engine would wait 5 s (its floor)
    with trio.fail_after(120):
        async with open_receiver(SIZE, "paused") as rank:
            engine = await MooncakeEngine.create(MooncakeSettings(progress_timeout=PROGRESS))
            source = torch.full((SIZE,), 3, dtype=torch.uint8)
            address = int(source.data_ptr())
            await engine.register(address, SIZE)
            await engine.transfer(Write(rank.session_id, [(address, 4096)], rank.address))
            rank.freeze()
            submitted = trio.Event()
            started = trio.current_time()
            with trio.move_on_after(1.0) as deadline:
                await engine.transfer(
                    Write(rank.session_id, [(address, SIZE)], rank.address), submitted=submitted
                )
            waited = trio.current_time() - started
            assert deadline.cancelled_caught
            assert submitted.is_set()
            assert waited < 2.5, f"the caller waited {waited:.1f} s for a transfer it left"
            assert engine.reading(address, SIZE)
            rank.thaw()
            await engine.settled(address, SIZE)
            assert not engine.reading(address, SIZE)
            own = xxhash.xxh3_64_intdigest(source.numpy().data)
            assert await rank.check(0, SIZE, [own], SIZE) == [True]
            await engine.deregister(address)
