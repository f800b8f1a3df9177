"""Prefill nodes as an operator's failures make them: real processes that freeze.

A :class:`Node` is ``tp`` receiver processes (:mod:`trio_encode.tools.soak.receiver`, each its
own Mooncake engine and registered pool) on one loopback address of its own (127.0.0.2, .3,
...), so the server's per-host bounds see one host per node as they would in a deployment;
its HTTP calls leave from that address too, since the server names a client by it. A
:class:`Served` is a ``trio-encode serve`` child process and the calls a test makes to it,
every 200's bytes checked against the model's embedding and every slot re-checked for writes
after its answer (:class:`~trio_encode.tools.soak.drill.Rank`).

:func:`frozen` SIGSTOPs ranks and always SIGCONTs them on the way out, whatever the test did.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import httpx
import trio

from trio_encode.encoder import EncoderSettings
from trio_encode.tools.soak.drill import Call, CheckedImages, Rank, post
from trio_encode.tools.soak.receiver import open_receiver
from trio_encode.tools.soak.server import ServerProcess, open_server_process

TINY = EncoderSettings(
    image_size=32, patch_size=16, width=32, depth=1, heads=1, hidden_size=1024, torch_threads=1
)
"""Four tokens of 1024 floats (16 KiB) per image: the transfers, not the model, are tested."""
TINY_ARGS = (
    *("--image-size", str(TINY.image_size), "--patch-size", str(TINY.patch_size)),
    *("--width", str(TINY.width), "--depth", str(TINY.depth), "--heads", str(TINY.heads)),
    *("--hidden-size", str(TINY.hidden_size), "--torch-threads", "1"),
    *("--max-batch-wait", "0", "--shutdown-grace", "2"),
)
"""Its ``trio-encode serve`` flags."""
DIRTY_SECONDS = 20.0
"""How long a slot whose send failed rests before reuse (a transfer may still land in it)."""


@dataclass(eq=False)
class Node:
    """One prefill node: its ranks, on one loopback address, and an HTTP client calling from it."""

    host: str
    ranks: list[Rank]
    http: httpx.AsyncClient


@asynccontextmanager
async def frozen(ranks: Iterable[Rank]) -> AsyncIterator[None]:
    """SIGSTOP every rank for the body; SIGCONT each on the way out, always (a test that fails
    or is cancelled must not leave a paused process behind for the rest of the run)."""
    held = list(ranks)
    try:
        for rank in held:
            rank.receiver.freeze()
        yield
    finally:
        for rank in held:
            if rank.receiver.alive:
                rank.receiver.thaw()


def node_ranks(nodes: Iterable[Node]) -> list[Rank]:
    return [rank for node in nodes for rank in node.ranks]


@dataclass(eq=False)
class Served:
    """A ``trio-encode serve`` process, the images whose embeddings are checked, and where the
    slots of checked sends rest."""

    server: ServerProcess
    workload: CheckedImages
    nursery: trio.Nursery
    stack: AsyncExitStack
    ranks: list[Rank] = field(default_factory=list)
    """Every rank opened through it."""

    async def open_nodes(
        self, hosts: Sequence[str], tp: int, slots: int = 4, name: str = "n"
    ) -> list[Node]:
        """A node of ``tp`` ranks on each of ``hosts`` (receivers started concurrently: each
        loads Mooncake), every rank with ``slots`` slots of one image."""
        part = self.workload.bytes_per_image
        opened: dict[tuple[int, int], Rank] = {}

        async def one(h: int, r: int) -> None:
            receiver = await self.stack.enter_async_context(
                open_receiver(slots * part, name=f"{name}{h}r{r}", host=hosts[h])
            )
            opened[h, r] = Rank(receiver, part, dirty_seconds=DIRTY_SECONDS)
            self.ranks.append(opened[h, r])

        async with trio.open_nursery() as nursery:
            for h in range(len(hosts)):
                for r in range(tp):
                    nursery.start_soon(one, h, r)
        nodes = []
        for h, host in enumerate(hosts):
            transport = httpx.AsyncHTTPTransport(local_address=host)
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            http = await self.stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=self.server.url, timeout=120, transport=transport, limits=limits
                )
            )
            nodes.append(Node(host, [opened[h, r] for r in range(tp)], http))
        return nodes

    async def encode(self, node: Node, req_id: str, image: int, receive_count: int) -> Call:
        body = {
            "req_id": req_id,
            "mm_items": [self.workload.items[image]],
            "receive_count": receive_count,
        }
        call, answer = await post(node.http, "/encode", body, rank=node.host)
        if call.status == 200:
            assert answer["embedding_size"] == self.workload.bytes_per_image
        return call

    async def send(self, node: Node, rank: Rank, req_id: str, image: int) -> Call:
        """/send into a fresh slot of ``rank``; a 200's bytes must be the image's embedding."""
        async with rank.slot(self.nursery) as slot:
            body = {"req_id": req_id, "session_id": rank.session_id, "buffer_address": slot.address}
            call, _ = await post(node.http, "/send", body, rank=rank.name)
            if call.status == 200:
                assert await rank.check(slot, req_id, [self.workload.digests[image]]), call
            else:
                slot.dirty = True
        return call

    async def request(self, node: Node, req_id: str, image: int) -> float:
        """A whole request of ``node``: /encode, then every rank's /send at once; each must
        answer 200 with the image's bytes. Returns the seconds the sends took."""
        encoded = await self.encode(node, req_id, image, len(node.ranks))
        assert encoded.status == 200, encoded
        calls: list[Call] = []

        async def one(rank: Rank) -> None:
            calls.append(await self.send(node, rank, req_id, image))

        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            for rank in node.ranks:
                nursery.start_soon(one, rank)
        seconds = time.monotonic() - started
        assert [call.status for call in calls] == [200] * len(node.ranks), calls
        return seconds


@asynccontextmanager
async def serving(
    workload: CheckedImages, args: Sequence[str], env: dict[str, str] | None = None
) -> AsyncIterator[Served]:
    """``trio-encode serve`` with the tiny model and ``args``. On exit the slots answered 200
    are checked once more (none may have been written after its answer), then every node
    opened through it is stopped (SIGCONT, then SIGKILL), then the server."""
    async with AsyncExitStack() as outer:
        server = await outer.enter_async_context(
            open_server_process([*TINY_ARGS, *args], env, stop_timeout=20)
        )
        nursery = await outer.enter_async_context(trio.open_nursery())
        async with AsyncExitStack() as stack:
            served = Served(server, workload, nursery, stack)
            yield served
            await trio.sleep(Rank.quiet_seconds + 0.3)  # checked slots rest, then are re-read
            nursery.cancel_scope.cancel()
            late = {rank.name: rank.late_writes for rank in served.ranks if rank.late_writes}
            assert not late, f"written after a 200: {late}"
