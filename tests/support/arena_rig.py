"""Request scopes over a registered arena, on the in-memory engine: the arena, its segments
and the encode callables that hand them over."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import torch

from support.lifecycle_rig import Rig, lifecycle_rig
from trio_encode.arena import Arena, Segment
from trio_encode.embedding import ArenaEmbedding
from trio_encode.ledger import Lease

ROWS, DIM = 64, 32
SEGMENT = ROWS * DIM * 4


def fill(arena: Arena, seed: int) -> tuple[Segment, torch.Tensor]:
    """A segment holding a (ROWS, DIM) float32 row drawn from ``seed``."""
    segment = arena.allocate(SEGMENT)
    assert segment is not None
    view = torch.frombuffer(segment.buffer, dtype=torch.uint8).view(torch.float32)
    view = view.view(ROWS, DIM)
    view.copy_(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed)))
    return segment, view


@asynccontextmanager
async def arena_rig(**kwargs: float) -> AsyncIterator[tuple[Rig, Arena, Lease]]:
    """A lifecycle rig whose ledger holds a registered arena, as the service sets it up."""
    async with lifecycle_rig(**kwargs) as rig:
        arena = Arena(1 << 20)
        lease = await rig.ledger.acquire(arena.address, arena.nbytes, owner=arena)
        yield rig, arena, lease


def opener(embedding: ArenaEmbedding) -> Callable[[], Awaitable[ArenaEmbedding]]:
    """An encode callable handing over ``embedding`` and the segment leases it holds."""

    async def encode() -> ArenaEmbedding:
        return embedding

    return encode
