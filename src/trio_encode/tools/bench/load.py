"""The bench's load generator and receiver ranks, in a process of their own.

In a deployment the clients calling ``/encode`` and the prefill ranks receiving the
embeddings run on other machines. Run in the server's process they would share its GIL and
event loop, and charge their own HTTP and Mooncake work to the server. So the bench starts
this module as a child process (its niceness is an option; raising it to 10 made the
served forward slower, not faster, on 2 cores) that opens its own receiver ranks, each with
its own Mooncake engine and registered landing pool. Two modes:

- ``encode`` (the encoder rows): N clients loop ``/encode`` then ``/send`` with
  natural-looking JPEGs. Commands: ``start`` starts the clients, ``mark`` answers how many
  ``/encode`` calls have answered so far, ``stop`` lets each client finish its request;
- ``send`` (the transfer rows): the ready answer names every rank's ``session_id`` and slot
  address (so the parent can also write into them directly, the raw rows). Command
  ``sends {"url", "req_ids", "tp"}``: the first ``tp`` ranks each send every req_id in turn,
  as prefill ranks do; the answer is the seconds that took. Then each rank's last landing is
  checked against the checksum its answer carried.

``exit`` closes the ranks and leaves. The first line on stdin is a :class:`LoadConfig` as
JSON; the child answers ``ready`` once prepared. Answers are JSON lines on stdout.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import trio

from trio_encode.client import EncodeClient, LandingPool, LandingSlot
from trio_encode.client.http import answer_of
from trio_encode.client.transport import KeepAliveTransport
from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings
from trio_encode.testing.images import mixed_jpegs, natural_jpegs

_JSON = {"Content-Type": "application/json"}


def http_client(base_url: str = "") -> httpx.AsyncClient:
    """The bench's HTTP client: the project's keep-alive transport, which drops idle
    connections before the servers' keep-alive closes them (the phases leave connections idle
    for seconds, and a request written into a closing connection fails)."""
    return httpx.AsyncClient(base_url=base_url, timeout=300, transport=KeepAliveTransport())


IMAGES_PER_CLIENT = 8
"""Distinct images each client cycles through, so no two requests in flight repeat one."""


@dataclass(frozen=True)
class LoadConfig:
    url: str
    concurrency: int
    tp: int
    image_size: int
    bytes_per_image: int
    engine: MooncakeSettings
    nice: int
    """Added to the child's niceness (the bench's ``load_nice``)."""
    seed: int = 0
    mode: str = "encode"
    """``encode`` (clients loop /encode then /send) or ``send`` (ranks send given req_ids)."""
    landing_bytes: int = 0
    """In ``send`` mode, each rank's slot: the largest embedding it will receive."""
    image_sizes: tuple[tuple[int, int], ...] = ()
    """In ``encode`` mode, (width, height) of the clients' images in turn (empty: squares of
    ``image_size``)."""


def _item_json(jpeg: bytes) -> bytes:
    return json.dumps(["data:image/jpeg;base64," + base64.b64encode(jpeg).decode()]).encode()


class _Lines:
    """Newline-separated messages over a byte stream."""

    def __init__(self, receive: trio.abc.ReceiveStream, send: trio.abc.SendStream) -> None:
        self._receive, self._send, self._buffer = receive, send, b""

    async def read(self) -> str:
        while b"\n" not in self._buffer:
            chunk = await self._receive.receive_some(1 << 16)
            if not chunk:
                raise EOFError("the other side closed the stream")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    async def write(self, line: str) -> None:
        await self._send.send_all(line.encode() + b"\n")


# -- the child ----------------------------------------------------------------------------------


async def _child(lines: _Lines) -> None:
    raw = json.loads(await lines.read())
    config = LoadConfig(**{**raw, "engine": MooncakeSettings(**raw["engine"])})
    os.nice(config.nice)
    if config.mode == "send":
        await _send_child(lines, config)
        return
    count = config.concurrency * IMAGES_PER_CLIENT
    if config.image_sizes:
        jpegs = mixed_jpegs(count, [(w, h) for w, h in config.image_sizes], config.seed)
    else:
        jpegs = natural_jpegs(count, config.image_size, config.seed)
    items = [_item_json(jpeg) for jpeg in jpegs]
    per_rank = -(-config.concurrency // config.tp)
    async with AsyncExitStack() as stack:
        pools = []
        for _ in range(config.tp):
            engine = await MooncakeEngine.create(config.engine)
            pool_bytes = per_rank * (config.bytes_per_image + 64) + 64
            pools.append(await stack.enter_async_context(LandingPool.open(engine, pool_bytes)))
        slots = [
            pools[k % config.tp].allocate(config.bytes_per_image) for k in range(config.concurrency)
        ]
        http = [await stack.enter_async_context(http_client(config.url)) for _ in range(config.tp)]
        await lines.write(json.dumps({"ready": sum(map(len, jpegs)) / len(jpegs)}))
        round_ = 0
        while (command := await lines.read()) == "start":
            await _child_round(lines, config, items, pools, slots, http, round_)
            await lines.write(json.dumps({"stopped": round_}))
            round_ += 1
        if command != "exit":
            raise ValueError(f"unknown command {command!r}")


async def _child_round(
    lines: _Lines,
    config: LoadConfig,
    items: list[bytes],
    pools: list[LandingPool],
    slots: list[LandingSlot],
    http: list[httpx.AsyncClient],
    round_: int,
) -> None:
    """Clients run until ``stop``; each ``mark`` meanwhile answers the count."""
    done = 0
    stopping = trio.Event()

    async def client(k: int) -> None:
        nonlocal done
        pool, slot = pools[k % config.tp], slots[k]
        raw, sender = http[k % config.tp], EncodeClient(config.url, http=http[k % config.tp])
        i = 0
        while not stopping.is_set():
            req_id = f"bench-encode-{round_}-{k}-{i}"
            item = items[(k + i * config.concurrency) % len(items)]
            i += 1
            body = (
                b'{"modality":"IMAGE","receive_count":1,"mm_items":'
                + item
                + b',"req_id":'
                + json.dumps(req_id).encode()
                + b"}"
            )
            answer_of(await raw.post("/encode", content=body, headers=_JSON))
            done += 1
            await sender.send(req_id, pool.session_id, slot.address)

    async with trio.open_nursery() as nursery:
        for k in range(config.concurrency):
            nursery.start_soon(client, k)
        while (command := await lines.read()) == "mark":
            await lines.write(json.dumps({"done": done}))
        if command != "stop":
            raise ValueError(f"unknown command {command!r}")
        stopping.set()


async def _send_child(lines: _Lines, config: LoadConfig) -> None:
    async with AsyncExitStack() as stack:
        pools = []
        for _ in range(config.tp):
            engine = await MooncakeEngine.create(config.engine)
            pools.append(
                await stack.enter_async_context(LandingPool.open(engine, config.landing_bytes))
            )
        slots = [pool.allocate(config.landing_bytes) for pool in pools]
        http = [await stack.enter_async_context(http_client()) for _ in pools]
        ranks = [[pool.session_id, slot.address] for pool, slot in zip(pools, slots, strict=True)]
        await lines.write(json.dumps({"ready": 0, "ranks": ranks}))
        while (command := await lines.read()).startswith("sends "):
            order = json.loads(command.removeprefix("sends "))
            seconds = await _send_round(
                order["url"], order["req_ids"], pools[: order["tp"]], slots, http
            )
            await lines.write(json.dumps({"seconds": seconds}))
        if command != "exit":
            raise ValueError(f"unknown command {command!r}")


async def _send_round(
    url: str,
    req_ids: list[str],
    pools: list[LandingPool],
    slots: list[LandingSlot],
    http: list[httpx.AsyncClient],
) -> float:
    """Every rank sends every req_id in turn; seconds until the last answered. Then each
    rank's last landing is verified against its answer's checksum (outside the time)."""
    last: list[dict[str, Any]] = [{} for _ in pools]

    async def rank(index: int) -> None:
        pool, slot = pools[index], slots[index]
        for req_id in req_ids:
            body = json.dumps(
                {"req_id": req_id, "session_id": pool.session_id, "buffer_address": slot.address}
            ).encode()
            response = await http[index].post(url + "/send", content=body, headers=_JSON)
            last[index] = answer_of(response)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(len(pools)):
            nursery.start_soon(rank, index)
    seconds = time.perf_counter() - start
    for slot, answer in zip(slots, last, strict=False):
        slot.verify(int(answer["embedding_size"]), str(answer["checksum"]))
    return seconds


async def _child_main() -> None:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    stdout = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))
    async with stdin, stdout:
        await _child(_Lines(stdin, stdout))


# -- the parent's handle -----------------------------------------------------------------------


class LoadProcess:
    """The parent's side of a running load process."""

    def __init__(
        self,
        process: trio.Process,
        lines: _Lines,
        mean_image_bytes: float,
        ranks: list[tuple[str, int]],
    ) -> None:
        self._process = process
        self._lines = lines
        self.mean_image_bytes = mean_image_bytes
        """Mean size of the JPEGs the clients send (``encode`` mode)."""
        self.ranks = ranks
        """Each rank's ``session_id`` and slot address (``send`` mode)."""

    async def _ask(self, command: str) -> Any:
        await self._lines.write(command)
        try:
            return json.loads(await self._lines.read())
        except EOFError:
            await self._process.wait()
            raise RuntimeError(
                f"the bench's load process exited with {self._process.returncode}"
            ) from None

    async def sends(self, url: str, req_ids: list[str], tp: int) -> float:
        """``send`` mode: seconds for the first ``tp`` ranks to each send every req_id."""
        order = json.dumps({"url": url, "req_ids": req_ids, "tp": tp})
        return float((await self._ask(f"sends {order}"))["seconds"])

    async def start(self) -> None:
        """Start the clients."""
        await self._lines.write("start")

    async def encoded(self) -> int:
        """/encode calls answered since :meth:`start`."""
        return int((await self._ask("mark"))["done"])

    async def stop(self) -> None:
        """Return once every client has finished its request and stopped."""
        await self._ask("stop")


@asynccontextmanager
async def open_load(config: LoadConfig) -> AsyncIterator[LoadProcess]:
    """Start the load process and wait until its ranks and images are ready."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_encode.tools.bench.load"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert process.stdin is not None
    assert process.stdout is not None
    lines = _Lines(process.stdout, process.stdin)
    try:
        await lines.write(json.dumps(asdict(config)))
        try:
            ready = json.loads(await lines.read())
        except EOFError:
            await process.wait()
            raise RuntimeError(
                f"the bench's load process exited with {process.returncode}"
            ) from None
        ranks = [(str(session), int(address)) for session, address in ready.get("ranks", [])]
        yield LoadProcess(process, lines, float(ready["ready"]), ranks)
        await lines.write("exit")
        with trio.fail_after(30):
            await process.wait()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
            await process.stdin.aclose()
            await process.stdout.aclose()


if __name__ == "__main__":
    trio.run(_child_main)
