"""``trio-encode bench``: each served path beside the raw part it is built on, in one run.

The server is the real one (hypercorn, quart-trio, request scopes, Mooncake over TCP) running
in this process, with TP receiver ranks that each own a Mooncake engine and a landing pool:

- transfer: ``MooncakeEngine.transfer`` from the server's engine into the ranks' pools, TP
  streams at once, against the same bytes moved by ``/send`` (every rank sends every req_id;
  the req_ids are encoded before the clock starts, so only the sends are timed, by a server
  of their own whose cache makes that cheap);
- encoder: the model's forward in a loop at the server's batch size (the same backend object
  the server calls) against ``/encode`` over HTTP from N clients with distinct JPEGs (cache
  off, so every image is decoded and encoded), each request then completed by a ``/send`` so
  no scope lingers. The clients and their receiver ranks run in a child process
  (:mod:`trio_encode.bench.load`) at a lower priority, as they would run on other machines
  in a deployment: they do not share the server's GIL or event loop;
- a probe polling ``/health`` from this process while the encoder is served (one request
  per interval, so it costs the server little and is not slowed by the child's priority),
  and the process's peak RSS.

Raw and served phases alternate for ``rounds`` rounds and are pooled, so a neighbour's load
that comes or goes skews both sides alike. The transfer rows' clients and ranks share this
process and its cores with the server, so those served numbers are, if anything, pessimistic.
"""

from __future__ import annotations

import base64
import math
import resource
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import httpx
import torch
import trio

from trio_encode.bench.config import BenchConfig
from trio_encode.bench.encoder import distinct_pngs, measure_raw_for
from trio_encode.bench.load import LoadConfig, LoadProcess, open_load
from trio_encode.client import EncodeClient, LandingPool, LandingSlot, metric_value
from trio_encode.encoder import EncoderSettings, ImageEncoder, VisionBackend, load_backend
from trio_encode.engine.mooncake import MooncakeEngine
from trio_encode.server.metrics import Metrics
from trio_encode.server.serve import RunningServer, open_server
from trio_encode.service import ServiceSettings
from trio_encode.settings import ServerSettings

ENCODER_TARGET = 0.9
"""The served/raw encoder throughput aimed for."""
_SEND_WINDOW = 16
"""req_ids encoded ahead of their timed sends: bounds the embeddings held at once."""


@dataclass(frozen=True)
class TransferRow:
    images: int
    nbytes: int
    """Bytes of one transfer (one req_id's embedding)."""
    raw_bytes: int
    raw_seconds: float
    served_bytes: int
    served_seconds: float

    @property
    def raw_rate(self) -> float:
        """Bytes per second."""
        return self.raw_bytes / self.raw_seconds

    @property
    def served_rate(self) -> float:
        return self.served_bytes / self.served_seconds

    @property
    def ratio(self) -> float:
        return self.served_rate / self.raw_rate


@dataclass(frozen=True)
class EncoderRow:
    batch_size: int
    concurrency: int
    raw_images: int
    raw_seconds: float
    served_images: int
    served_seconds: float
    served_batches: int
    served_forward_seconds: float
    """Time the forward pass ran during the served windows (from the batcher's observer)."""
    served_images_in_batches: int
    """Images in the batches that finished during the served windows."""
    raw_spread: tuple[float, float]
    """Slowest and fastest raw images/s of the rounds (their gap shows the noise)."""
    served_spread: tuple[float, float]
    mean_image_bytes: float
    """Mean size of the JPEGs the clients sent."""

    @property
    def raw_rate(self) -> float:
        """Images per second."""
        return self.raw_images / self.raw_seconds

    @property
    def served_rate(self) -> float:
        return self.served_images / self.served_seconds

    @property
    def ratio(self) -> float:
        return self.served_rate / self.raw_rate

    @property
    def mean_batch(self) -> float:
        return self.served_images_in_batches / max(1, self.served_batches)

    @property
    def forward_busy(self) -> float:
        """Share of the served time the model was running: below 1, the batcher left it idle
        (batches straddling a window's edges count whole, so it can read a little over 1)."""
        return self.served_forward_seconds / self.served_seconds

    @property
    def served_forward_rate(self) -> float:
        """Images per second of forward time while served: below the raw rate, the forward
        itself ran slower (cores taken by decoding, HTTP, the clients)."""
        return self.served_images_in_batches / max(1e-9, self.served_forward_seconds)


@dataclass(frozen=True)
class ProbeRow:
    interval: float
    probes: int
    ok: int
    """Probes answered 200."""
    p99_seconds: float
    max_seconds: float


@dataclass(frozen=True)
class BenchResult:
    model_id: str
    dtype: str
    bytes_per_image: int
    tp: int
    rounds: int
    torch_threads: int
    transfers: list[TransferRow]
    encoder: EncoderRow
    health: ProbeRow
    rss_after_load_bytes: int
    rss_after_transfers_bytes: int
    """Peak RSS after the transfer rows (before the encoder rows ran)."""
    peak_rss_bytes: int
    registrations_left: int
    scopes_left: int
    seconds: float

    def ratios(self) -> dict[str, float]:
        """Every served/raw ratio, by row name."""
        found = {f"transfer_{row.images}": row.ratio for row in self.transfers}
        found["encoder"] = self.encoder.ratio
        return found

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ratios"] = self.ratios()
        data["encoder"]["mean_batch"] = self.encoder.mean_batch
        data["encoder"]["forward_busy"] = self.encoder.forward_busy
        data["encoder"]["raw_rate"] = self.encoder.raw_rate
        data["encoder"]["served_rate"] = self.encoder.served_rate
        for row, out in zip(self.transfers, data["transfers"], strict=True):
            out["raw_rate"], out["served_rate"] = row.raw_rate, row.served_rate
        return data

    def table(self) -> str:
        e, h = self.encoder, self.health
        lines = [
            f"trio-encode bench: {self.model_id}",
            f"{_size(self.bytes_per_image)} per image, TP={self.tp}, "
            f"torch threads {self.torch_threads}, {self.rounds} alternating rounds, "
            f"{self.seconds:.0f} s in all",
            "",
            f"{'':34}{'raw':>14}{'served':>14}{'served/raw':>12}",
        ]
        for row in self.transfers:
            name = f"transfer {_size(row.nbytes)} x {self.tp} ranks"
            lines.append(
                f"{name:34}{_size(row.raw_rate) + '/s':>14}{_size(row.served_rate) + '/s':>14}"
                f"{row.ratio:>12.2f}"
            )
        name = f"encoder B={e.batch_size}, {e.concurrency} clients"
        target = "ok" if e.ratio >= ENCODER_TARGET else "BELOW"
        lines += [
            f"{name:34}{e.raw_rate:>8.1f} img/s{e.served_rate:>8.1f} img/s{e.ratio:>12.2f}"
            f"  (target >= {ENCODER_TARGET}: {target})",
            f"  served: mean batch {e.mean_batch:.2f}, forward busy {e.forward_busy:.0%}, "
            f"forward alone {e.served_forward_rate:.1f} img/s; rounds raw "
            f"{e.raw_spread[0]:.1f}..{e.raw_spread[1]:.1f}, served "
            f"{e.served_spread[0]:.1f}..{e.served_spread[1]:.1f} img/s; "
            f"JPEGs of {_size(e.mean_image_bytes)} on average, clients in a separate process",
            f"/health every {h.interval * 1000:.0f} ms while encoding: {h.ok}/{h.probes} got 200, "
            f"p99 {h.p99_seconds * 1000:.1f} ms, max {h.max_seconds * 1000:.1f} ms",
            f"memory: peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB "
            f"(after loading the model {self.rss_after_load_bytes / 2**20:.0f} MiB, after the "
            f"transfer rows {self.rss_after_transfers_bytes / 2**20:.0f} MiB); "
            f"left at the end: {self.registrations_left} registrations, "
            f"{self.scopes_left} scopes",
        ]
        return "\n".join(lines)


class _BenchMetrics(Metrics):
    """The server's metrics, also keeping every batch's size and forward time."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[int, float]] = []

    def batch_finished(self, images: int, forward_seconds: float, ok: bool) -> None:
        super().batch_finished(images, forward_seconds, ok)
        self.batches.append((images, forward_seconds))


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _peak_rss() -> int:
    """Peak resident set of this process in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0


_JSON = {"Content-Type": "application/json"}


async def _deregister_shielded(engine: MooncakeEngine, address: int) -> None:
    """Cleanup that a cancelled bench must still finish."""
    with trio.CancelScope(shield=True):
        await engine.deregister(address)


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@dataclass
class _Rig:
    """One server and what the phases run against it share."""

    config: BenchConfig
    running: RunningServer
    engine: MooncakeEngine
    backend: VisionBackend
    settings: EncoderSettings
    metrics: _BenchMetrics
    bytes_per_image: int
    ranks: list[LandingPool]
    clients: list[EncodeClient]
    """One HTTP client (connection pool) per rank."""
    http: list[httpx.AsyncClient]
    """The connection pools under ``clients``, for requests sent as prepared bytes."""
    source: torch.Tensor
    """Registered on the server's engine: what the raw transfers send."""
    rank_slots: list[LandingSlot]
    """One slot per rank, large enough for the largest transfer."""


@asynccontextmanager
async def _open_rig(
    config: BenchConfig,
    backend: VisionBackend,
    settings: EncoderSettings,
    ranks: list[LandingPool],
    rank_slots: list[LandingSlot],
    source: torch.Tensor,
) -> AsyncIterator[_Rig]:
    """A server (with its own engine and batcher over the shared model) and clients for it;
    on exit the server is stopped and every scope has ended."""
    metrics = _BenchMetrics()
    engine = await MooncakeEngine.create(config.engine)
    encoder = ImageEncoder(backend, settings, observer=metrics)
    server_settings = ServerSettings.exactly(
        port=0,
        engine=config.engine,
        encoder=settings,
        service=ServiceSettings(shutdown_grace=5.0),
        access_log=False,
    )
    async with AsyncExitStack() as stack:
        running = await stack.enter_async_context(
            open_server(server_settings, engine=engine, encoder=encoder, metrics=metrics)
        )
        http = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=running.url, timeout=300))
            for _ in ranks
        ]
        clients = [EncodeClient(running.url, http=pool) for pool in http]
        await engine.register(int(source.data_ptr()), source.numel())
        stack.push_async_callback(_deregister_shielded, engine, int(source.data_ptr()))
        yield _Rig(
            config=config,
            running=running,
            engine=engine,
            backend=backend,
            settings=settings,
            metrics=metrics,
            bytes_per_image=encoder.info.bytes_per_image,
            ranks=ranks,
            clients=clients,
            http=http,
            source=source,
            rank_slots=rank_slots,
        )


async def _leftovers(rig: _Rig) -> tuple[int, int]:
    """Registrations and scopes the server still holds: both 0 once every request ended.
    A scope ends just after its last /send answered, so give it a moment (at most 5 s)."""
    left = (1, 1)
    with trio.move_on_after(5):
        while any(left):
            text = await rig.clients[0].metrics()
            left = (
                int(metric_value(text, "trio_encode_live_registrations")),
                int(metric_value(text, "trio_encode_live_scopes")),
            )
            if any(left):
                await trio.sleep(0.02)
    return left


async def run_bench(config: BenchConfig) -> BenchResult:
    """Run every phase with one model instance; see the module's doc."""
    started = time.perf_counter()
    # The encoder rows: cache off, so every image is decoded and run through the model.
    encode_settings = replace(
        config.encoder,
        cache_bytes=0,
        queue_size=max(config.encoder.queue_size, config.concurrency),
        warmup=True,
    )
    backend = await trio.to_thread.run_sync(load_backend, encode_settings)
    rss_after_load = _peak_rss()
    info = ImageEncoder(backend, encode_settings).info
    per_image = info.bytes_per_image
    # The transfer rows' server keeps a cache, so the one image their req_ids repeat is
    # encoded once and the rounds can afford many sends (/send does not care where an
    # embedding came from; each req_id still has its own embedding and registration).
    transfer_settings = replace(encode_settings, cache_bytes=max(16 * per_image, 1 << 20))
    largest = max(config.transfer_images) * per_image
    per_rank_clients = -(-config.concurrency // config.tp)
    pool_bytes = largest + per_rank_clients * (per_image + 64) + 64
    rank_engines = [await MooncakeEngine.create(config.engine) for _ in range(config.tp)]
    source = torch.randint(1, 255, (largest,), dtype=torch.uint8)
    registrations_left = scopes_left = 0

    async with AsyncExitStack() as stack:
        pools = [
            await stack.enter_async_context(LandingPool.open(rank, pool_bytes))
            for rank in rank_engines
        ]
        rank_slots = [pool.allocate(largest) for pool in pools]
        async with _open_rig(config, backend, transfer_settings, pools, rank_slots, source) as rig:
            transfers = [await _transfer_row(rig, images) for images in config.transfer_images]
            registrations, scopes = await _leftovers(rig)
            registrations_left, scopes_left = (
                registrations_left + registrations,
                scopes_left + scopes,
            )
        rss_after_transfers = _peak_rss()
        async with _open_rig(config, backend, encode_settings, pools, rank_slots, source) as rig:
            encoder_row, health = await _encoder_rows(rig, encode_settings.max_batch_size)
            registrations, scopes = await _leftovers(rig)
            registrations_left, scopes_left = (
                registrations_left + registrations,
                scopes_left + scopes,
            )
    return BenchResult(
        model_id=backend.model_id,
        dtype=info.dtype,
        bytes_per_image=per_image,
        tp=config.tp,
        rounds=config.rounds,
        torch_threads=torch.get_num_threads(),
        transfers=transfers,
        encoder=encoder_row,
        health=health,
        rss_after_load_bytes=rss_after_load,
        rss_after_transfers_bytes=rss_after_transfers,
        peak_rss_bytes=_peak_rss(),
        registrations_left=registrations_left,
        scopes_left=scopes_left,
        seconds=time.perf_counter() - started,
    )


# -- transfer ------------------------------------------------------------------------------------


async def _transfer_row(rig: _Rig, images: int) -> TransferRow:
    nbytes = images * rig.bytes_per_image
    raw_seconds = served_seconds = 0.0
    for round_ in range(rig.config.rounds):
        raw_seconds += await _raw_transfers(rig, nbytes)
        served_seconds += await _served_transfers(rig, images, nbytes, round_)
    total = rig.config.rounds * rig.config.transfer_requests * rig.config.tp * nbytes
    return TransferRow(images, nbytes, total, raw_seconds, total, served_seconds)


async def _raw_transfers(rig: _Rig, nbytes: int) -> float:
    """Seconds for TP streams of ``transfer_requests`` back-to-back transfers each."""
    source = int(rig.source.data_ptr())

    async def stream(rank: int) -> None:
        pool, slot = rig.ranks[rank], rig.rank_slots[rank]
        for _ in range(rig.config.transfer_requests):
            await rig.engine.transfer(pool.session_id, source, slot.address, nbytes)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for rank in range(rig.config.tp):
            nursery.start_soon(stream, rank)
    return time.perf_counter() - start


async def _served_transfers(rig: _Rig, images: int, nbytes: int, round_: int) -> float:
    """Seconds for every rank to /send each of ``transfer_requests`` req_ids, one at a time
    per rank as a prefill rank would. The req_ids are encoded (untimed) a window at a time,
    so the embeddings waiting for their sends stay few; the last send of a req_id ends its
    scope."""
    config = rig.config
    item = _data_uri(distinct_pngs(1, rig.backend.preprocess.image_size)[0])
    req_ids = [f"bench-send-{round_}-{images}-{i}" for i in range(config.transfer_requests)]
    # At most a queue's worth of images in flight, or the server would answer 503.
    window = max(1, min(_SEND_WINDOW, rig.settings.queue_size // images))

    async def encode(req_id: str) -> None:
        await rig.clients[0].encode(req_id, [item] * images, receive_count=config.tp)

    async def rank_sends(rank: int, batch: list[str]) -> None:
        client, pool, slot = rig.clients[rank], rig.ranks[rank], rig.rank_slots[rank]
        for req_id in batch:
            sent = await client.send(req_id, pool.session_id, slot.address)
            if sent.embedding_size != nbytes:
                raise RuntimeError(f"{req_id}: sent {sent.embedding_size} bytes, not {nbytes}")

    seconds = 0.0
    for first in range(0, len(req_ids), window):
        batch = req_ids[first : first + window]
        async with trio.open_nursery() as nursery:
            for req_id in batch:
                nursery.start_soon(encode, req_id)
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for rank in range(config.tp):
                nursery.start_soon(rank_sends, rank, batch)
        seconds += time.perf_counter() - start
    return seconds


# -- encoder -------------------------------------------------------------------------------------


@dataclass
class _ServedRound:
    images: int = 0
    seconds: float = 0.0
    batches: list[tuple[int, float]] = field(default_factory=list)


async def _encoder_rows(rig: _Rig, batch_size: int) -> tuple[EncoderRow, ProbeRow]:
    config = rig.config
    load_config = LoadConfig(
        url=rig.running.url,
        concurrency=config.concurrency,
        tp=config.tp,
        image_size=rig.backend.preprocess.image_size,
        bytes_per_image=rig.bytes_per_image,
        engine=config.engine,
        nice=config.load_nice,
    )
    raw_images, raw_seconds, raw_rates = 0, 0.0, []
    served: list[_ServedRound] = []
    latencies: list[float] = []
    statuses: list[int] = []
    async with open_load(load_config) as load:
        for _ in range(config.rounds):
            images, seconds = await trio.to_thread.run_sync(
                partial(
                    measure_raw_for, rig.backend, batch_size, config.raw_seconds / config.rounds
                )
            )
            raw_images, raw_seconds = raw_images + images, raw_seconds + seconds
            raw_rates.append(images / seconds)
            served.append(await _served_round(rig, load, latencies, statuses))
    batches = [batch for round_ in served for batch in round_.batches]
    encoder = EncoderRow(
        batch_size=batch_size,
        concurrency=config.concurrency,
        raw_images=raw_images,
        raw_seconds=raw_seconds,
        served_images=sum(r.images for r in served),
        served_seconds=sum(r.seconds for r in served),
        served_batches=len(batches),
        served_forward_seconds=sum(seconds for _, seconds in batches),
        served_images_in_batches=sum(images for images, _ in batches),
        raw_spread=(min(raw_rates), max(raw_rates)),
        served_spread=(
            min(r.images / r.seconds for r in served),
            max(r.images / r.seconds for r in served),
        ),
        mean_image_bytes=load.mean_image_bytes,
    )
    probe = ProbeRow(
        interval=config.probe_interval,
        probes=len(statuses),
        ok=sum(status == 200 for status in statuses),
        p99_seconds=_percentile(latencies, 0.99),
        max_seconds=max(latencies, default=0.0),
    )
    return encoder, probe


async def _served_round(
    rig: _Rig, load: LoadProcess, latencies: list[float], statuses: list[int]
) -> _ServedRound:
    """The load process's clients loop /encode + /send; the images whose /encode answered
    inside the window count. Stopping lets each client finish its request, so no scope is
    left behind to expire."""
    config = rig.config
    result = _ServedRound()
    stopping = trio.Event()

    async def probe(http: httpx.AsyncClient) -> None:
        while not stopping.is_set():
            start = time.perf_counter()
            response = await http.get("/health")
            latencies.append(time.perf_counter() - start)
            statuses.append(response.status_code)
            await trio.sleep(config.probe_interval)

    async with (
        httpx.AsyncClient(base_url=rig.running.url, timeout=30) as probe_http,
        trio.open_nursery() as nursery,
    ):
        await load.start()
        nursery.start_soon(probe, probe_http)
        await trio.sleep(config.settle_seconds)
        first_batch, before = len(rig.metrics.batches), await load.encoded()
        start = time.perf_counter()
        await trio.sleep(config.served_seconds / config.rounds)
        after, result.seconds = await load.encoded(), time.perf_counter() - start
        result.images = after - before
        result.batches = rig.metrics.batches[first_batch:]
        stopping.set()
        await load.stop()
    return result
