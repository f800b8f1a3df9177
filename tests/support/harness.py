"""An in-process server on a free loopback port, TP landing pools, and /metrics readings."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch
import trio

from trio_encode.client import EncodeClient, LandingPool, LandingSlot, metric_value
from trio_encode.encoder import ImageEncoder
from trio_encode.engine import TransferEngine
from trio_encode.server.serve import RunningServer, open_server
from trio_encode.service import Encoder
from trio_encode.settings import ServerSettings
from trio_encode.testing.stand_in_encoder import StandInEncoder

from .engines import TP, RankEngines
from .models import SMALL_ROW, direct


@dataclass
class Harness:
    running: RunningServer
    client: EncodeClient
    encoder: Encoder

    async def metrics(self) -> str:
        return await self.client.metrics()

    async def value(self, name: str, **labels: str) -> float:
        return metric_value(await self.metrics(), name, **labels)

    async def settled(self, within: float = 5.0) -> str:
        """/metrics once no scope and no registration but the arena's is live (the last
        answer of a scope can arrive a moment before the scope has released); fails after
        ``within`` seconds."""
        arena = 0 if self.encoder.arena is None else 1
        with trio.move_on_after(within):
            while True:
                text = await self.metrics()
                if (
                    metric_value(text, "live_scopes") == 0
                    and metric_value(text, "live_registrations") == arena
                ):
                    return text
                await trio.sleep(0.02)
        raise AssertionError(f"scopes or registrations still live:\n{await self.metrics()}")


@asynccontextmanager
async def http_server(
    engine: TransferEngine, encoder: Encoder | None = None, **settings: Any
) -> AsyncIterator[Harness]:
    """A server on ``127.0.0.1:0`` for the body of the ``async with``, and a client for it."""
    encoder = encoder if encoder is not None else StandInEncoder()
    config = ServerSettings.exactly(port=0, **settings)
    async with (
        open_server(config, engine=engine, encoder=encoder) as running,
        EncodeClient(running.url, token=config.token) as client,
    ):
        yield Harness(running, client, encoder)


@asynccontextmanager
async def landing_pools(rank_engines: RankEngines, nbytes: int) -> AsyncIterator[list[LandingPool]]:
    """One registered pool of ``nbytes`` on each rank's engine."""
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(LandingPool.open(e, nbytes)) for e in rank_engines.ranks
        ]


async def run_ranks(
    client: EncodeClient,
    pools: list[LandingPool],
    requests: dict[str, list[str]],
    row_bytes: int | None = None,
) -> dict[tuple[str, int], LandingSlot]:
    """Every rank encodes and sends every request, all at once; the slots they landed in
    (each checked against the answer's checksum, and with ``row_bytes`` the answer's size
    against that many bytes an image)."""
    landed: dict[tuple[str, int], LandingSlot] = {}

    async def rank(req_id: str, r: int) -> None:
        encoded = await client.encode(req_id, requests[req_id], receive_count=TP)
        if row_bytes is not None:
            assert encoded.embedding_size == len(requests[req_id]) * row_bytes
        slot = pools[r].allocate(encoded.embedding_size)
        sent = await client.send(req_id, pools[r].session_id, slot.address)
        slot.verify(sent.embedding_size, sent.checksum)
        landed[req_id, r] = slot

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for req_id in requests:
                for r in range(TP):
                    nursery.start_soon(rank, req_id, r)
    return landed


async def serve_small_model_to_every_rank(
    rank_engines: RankEngines, encoder: ImageEncoder, requests: dict[str, list[str]]
) -> str:
    """Serve ``requests`` (for :data:`~support.models.SMALL` models) to every rank at once over
    HTTP; each rank's copy of each request must be, byte for byte, what the model computes
    directly. Returns ``/metrics`` once settled."""
    images = sum(len(uris) for uris in requests.values())
    async with (
        http_server(rank_engines.server, encoder=encoder) as harness,
        landing_pools(rank_engines, images * SMALL_ROW + 4096) as pools,
    ):
        landed = await run_ranks(harness.client, pools, requests, row_bytes=SMALL_ROW)
        text = await harness.settled()
        for req_id, uris in requests.items():
            expected = direct(encoder, uris)
            for r in range(TP):
                copy = landed[req_id, r].read(*expected.shape, "float32")
                assert torch.equal(copy, expected), (req_id, r)
    return text
