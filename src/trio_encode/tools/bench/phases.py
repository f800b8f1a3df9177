"""The timed phases of ``trio-encode bench``: each is one side of a row.

Transfer rows: the raw side writes from the server's engine straight into the load process's
ranks; the served and peer sides encode a window of req_ids first (untimed) and then time the
ranks' sends, which run in the load process. Encoder rows: the model's forward in a loop, and
``/encode`` from the load process's clients while a probe polls ``/health``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import httpx
import trio

from trio_encode.client import EncodeClient
from trio_encode.client.http import answer_of
from trio_encode.encoder import Prepared, VisionModel
from trio_encode.engine import TransferEngine, Write
from trio_encode.server.metrics import Metrics
from trio_encode.testing.images import image_uri, noise_pngs
from trio_encode.tools.bench.load import LoadProcess

WINDOW_BYTES = 256 << 20
"""Embeddings encoded ahead of their timed sends, at most: bounds the memory a phase holds."""
_JSON = {"Content-Type": "application/json"}


class Progress:
    """One line on stderr per phase, so a long run shows where it is."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.started = time.perf_counter()

    def say(self, text: str) -> None:
        if self.enabled:
            elapsed = time.perf_counter() - self.started
            print(f"[{elapsed:6.0f} s] {text}", file=sys.stderr, flush=True)


def window_for(nbytes: int, requests: int) -> int:
    """How many req_ids of ``nbytes`` to encode ahead of one timed batch of sends."""
    return max(1, min(requests, WINDOW_BYTES // nbytes))


# -- transfer rows ------------------------------------------------------------------------------


async def raw_transfers(
    engine: TransferEngine, source: int, ranks: list[tuple[str, int]], nbytes: int, count: int
) -> float:
    """Seconds for ``len(ranks)`` streams of ``count`` back-to-back transfers each, from the
    registered ``source`` into each rank's slot."""

    async def stream(session_id: str, address: int) -> None:
        for _ in range(count):
            await engine.transfer(Write(session_id, [(source, nbytes)], address))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for session_id, address in ranks:
            nursery.start_soon(stream, session_id, address)
    return time.perf_counter() - start


async def served_sends(
    client: EncodeClient, load: LoadProcess, url: str, tp: int, req_ids: list[str], nbytes: int
) -> float:
    """Seconds the ranks took to ``/send`` every req_id; each window is encoded first,
    untimed, with distinct images (so no two req_ids share an embedding)."""
    window = window_for(nbytes, len(req_ids))
    images = [image_uri(png) for png in noise_pngs(window)]
    seconds = 0.0
    for first in range(0, len(req_ids), window):
        batch = req_ids[first : first + window]
        async with trio.open_nursery() as nursery:
            for req_id, item in zip(batch, images, strict=False):
                nursery.start_soon(partial(client.encode, req_id, [item], receive_count=tp))
        seconds += await load.sends(url, batch, tp)
    return seconds


async def peer_sends(
    http: httpx.AsyncClient, load: LoadProcess, url: str, tp: int, req_ids: list[str], nbytes: int
) -> float:
    """The same sends through the peer: its ``/encode`` fills each embedding (untimed)."""
    window = window_for(nbytes, len(req_ids))
    seconds = 0.0
    for first in range(0, len(req_ids), window):
        batch = req_ids[first : first + window]

        async def encode(req_id: str, seed: int) -> None:
            body = {"req_id": req_id, "nbytes": nbytes, "receive_count": tp, "seed": seed}
            answer_of(await http.post(url + "/encode", content=json.dumps(body), headers=_JSON))

        async with trio.open_nursery() as nursery:
            for seed, req_id in enumerate(batch):
                nursery.start_soon(encode, req_id, seed)
        seconds += await load.sends(url, batch, tp)
    return seconds


# -- encoder rows -------------------------------------------------------------------------------


class BatchRecorder(Metrics):
    """The server's metrics, also keeping every batch's size and forward time."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[int, float]] = []

    def batch_finished(self, images: int, forward_seconds: float, ok: bool) -> None:
        super().batch_finished(images, forward_seconds, ok)
        self.batches.append((images, forward_seconds))


def raw_forward_for(
    model: VisionModel, images: Sequence[Prepared], seconds: float, *, warmups: int = 1
) -> tuple[int, float]:
    """In a worker thread: images and seconds of back-to-back forwards of ``images`` (one
    batch, as the server would form it) for at least ``seconds`` (at least one), after
    ``warmups`` untimed ones. Timed rather than counted so raw and served phases weigh alike
    whatever the model's speed."""
    for _ in range(warmups):
        model.encode(images)
    start = time.perf_counter()
    count = 0
    while True:
        model.encode(images)
        count += len(images)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count, elapsed


@dataclass
class ServedRound:
    images: int = 0
    seconds: float = 0.0
    batches: list[tuple[int, float]] = field(default_factory=list)


async def served_encode_round(
    url: str,
    metrics: BatchRecorder,
    load: LoadProcess,
    *,
    seconds: float,
    settle: float,
    probe_interval: float,
    latencies: list[float],
    statuses: list[int],
) -> ServedRound:
    """The load process's clients loop /encode + /send; the images whose /encode answered
    inside the window count. Stopping lets each client finish its request, so no scope is
    left behind to expire. A probe polls ``/health`` meanwhile."""
    result = ServedRound()
    stopping = trio.Event()

    async def probe(http: httpx.AsyncClient) -> None:
        while not stopping.is_set():
            start = time.perf_counter()
            response = await http.get("/health")
            latencies.append(time.perf_counter() - start)
            statuses.append(response.status_code)
            await trio.sleep(probe_interval)

    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as probe_http,
        trio.open_nursery() as nursery,
    ):
        await load.start()
        nursery.start_soon(probe, probe_http)
        await trio.sleep(settle)
        first_batch, before = len(metrics.batches), await load.encoded()
        start = time.perf_counter()
        await trio.sleep(seconds)
        after, result.seconds = await load.encoded(), time.perf_counter() - start
        result.images = after - before
        result.batches = metrics.batches[first_batch:]
        stopping.set()
        await load.stop()
    return result


def spread(rates: list[float]) -> tuple[float, float]:
    return (min(rates), max(rates)) if rates else (math.nan, math.nan)
