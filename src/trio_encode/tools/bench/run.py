"""``trio-encode bench``: each served path beside the raw part it is built on, and beside an
asyncio peer, in one run.

The servers are the real one (hypercorn, quart-trio, request scopes, Mooncake over TCP) in
this process. Everything that would be another machine in a deployment runs in a child
process (:mod:`trio_encode.tools.bench.load`): the receiver ranks, each with its own Mooncake engine
and landing pool, and the HTTP clients. The peer (:mod:`trio_encode.tools.bench.peer`) runs in a
process of its own.

- Transfer rows, per embedding size and TP: *raw* is ``MooncakeEngine.transfer`` from the
  server's engine into the ranks' slots, TP streams at once; *served* is ``/send`` of the same
  sizes, every rank sending every req_id in turn (the req_ids are encoded before the clock
  starts, each with its own image, by a server whose stand-in model produces that size), with
  the registered arena and without it; *peer* is the same sends through the peer. The
  registrations per request come from the server's ``/metrics``.
- Encoder rows: the model's forward in a loop at the server's batch size against ``/encode``
  from N clients with distinct JPEGs (cache off), each request completed by a ``/send``, with
  a probe polling ``/health``.
- Video row (``--vlm``): ``VIDEO`` parts through the encoder the service uses (``load_items``
  then ``encode``) from N callers, each with its own MP4, against the model's video path on
  the same prepared frames, one video a forward; and the share of the served time that
  decoding a video (``decode_video`` then ``prepare``) takes.

Within a round the phases of a row alternate, and rounds are pooled, so load that comes or
goes during the run skews every side alike.
"""

from __future__ import annotations

import base64
import resource
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import httpx
import torch
import trio

from trio_encode.arena import Arena
from trio_encode.client import EncodeClient, metric_value
from trio_encode.encoder import (
    EncoderSettings,
    ImageEncoder,
    Prepared,
    VisionModel,
    load_backend,
)
from trio_encode.encoder.video import decode_video
from trio_encode.encoder.vlm_video import PreparedVideo, VideoPath
from trio_encode.engine.mooncake import MooncakeEngine
from trio_encode.server.metrics import Metrics
from trio_encode.server.serve import RunningServer, open_server
from trio_encode.settings import ServerSettings
from trio_encode.testing.images import mixed_jpegs, natural_jpegs
from trio_encode.tools.bench.calls import Build, ServerProcess, run_calls
from trio_encode.tools.bench.calls import open_server as open_process_server
from trio_encode.tools.bench.load import (
    LoadConfig,
    LoadProcess,
    http_client,
    open_load,
)
from trio_encode.tools.bench.peer import open_peer
from trio_encode.tools.bench.phases import (
    BatchRecorder,
    Progress,
    ServedRound,
    peer_sends,
    raw_forward_for,
    raw_transfers,
    served_encode_round,
    served_sends,
    spread,
    window_for,
)
from trio_encode.tools.bench.results import (
    BenchResult,
    BuildRow,
    EncoderRow,
    ProbeRow,
    Rate,
    TransferRow,
    VideoRow,
    percentile,
    size_text,
)
from trio_encode.tools.bench.settings import BenchConfig
from trio_encode.tools.bench.synthetic import ROW_BYTES, SizedBackend, tokens_for
from trio_encode.tools.bench.videos import bench_videos


def _peak_rss() -> int:
    """Peak resident set of this process in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class _Served:
    """One server of the transfer rows and a client for it."""

    running: RunningServer
    client: EncodeClient
    arena: bool

    async def value(self, name: str) -> float:
        return metric_value(await self.client.metrics(), name)


@asynccontextmanager
async def _sized_server(
    engine: MooncakeEngine, nbytes: int, *, arena: bool, window: int
) -> AsyncIterator[_Served]:
    """A server whose every image's embedding is ``nbytes``; with its own arena or none."""
    settings = EncoderSettings(
        image_size=16,
        patch_size=16,
        max_batch_size=16,
        queue_size=max(64, 2 * window),
        cache_bytes=0,
        warmup=False,
    )
    backend = SizedBackend(tokens_for(nbytes))
    pool = Arena((window + 2) * nbytes + (1 << 20), cache_bytes=0) if arena else None
    encoder = ImageEncoder(backend, settings, arena=pool)
    server_settings = ServerSettings.exactly(port=0, encoder=settings, shutdown_grace=5.0)
    async with (
        open_server(server_settings, engine=engine, encoder=encoder, metrics=Metrics()) as running,
        EncodeClient(
            running.url,
            http=http_client(running.url),
        ) as client,
    ):
        yield _Served(running, client, arena)


async def _leftovers(served: _Served) -> tuple[int, int]:
    """Registrations (besides the arena's) and scopes still held; a scope ends just after its
    last /send answered, so allow a moment (at most 5 s)."""
    arena = 1 if served.arena else 0
    left = (1, 1)
    with trio.move_on_after(5):
        while any(left):
            left = (
                int(await served.value("live_registrations")) - arena,
                int(await served.value("live_scopes")),
            )
            if any(left):
                await trio.sleep(0.02)
    return left


@asynccontextmanager
async def _build_server(
    build: Build, nbytes: int, progress: Progress
) -> AsyncIterator[tuple[ServerProcess, EncodeClient]]:
    """``build``'s server of /send rows in a process of its own (arena on), and a client."""
    async with (
        open_process_server(build.name, ["send", str(nbytes), "arena"], build) as process,
        EncodeClient(url := f"http://127.0.0.1:{process.port}", http=http_client(url)) as client,
    ):
        yield process, client


async def _transfer_rows(
    config: BenchConfig, progress: Progress, builds: list[BuildRow]
) -> tuple[list[TransferRow], int, int]:
    sizes = [tokens_for(size) * ROW_BYTES for size in config.sizes]
    engine = await MooncakeEngine.create(config.engine)
    source = torch.randint(1, 255, (max(sizes),), dtype=torch.uint8)
    load_config = LoadConfig(
        url="",
        concurrency=1,
        tp=max(config.tps),
        image_size=16,
        bytes_per_image=0,
        engine=config.engine,
        nice=config.load_nice,
        mode="send",
        landing_bytes=max(sizes),
    )
    rows: list[TransferRow] = []
    left = [0, 0]
    async with AsyncExitStack() as stack:
        load = await stack.enter_async_context(open_load(load_config))
        peer_url = await stack.enter_async_context(open_peer()) if config.peer else None
        peer_http = await stack.enter_async_context(http_client())
        await engine.register(int(source.data_ptr()), source.numel())
        stack.push_async_callback(_deregister, engine, int(source.data_ptr()))
        for nbytes in sizes:
            rows += await _rows_for_size(
                config, progress, engine, int(source.data_ptr()), load, peer_url, peer_http,
                nbytes, left, builds,
            )  # fmt: skip
    return rows, left[0], left[1]


async def _rows_for_size(
    config: BenchConfig,
    progress: Progress,
    engine: MooncakeEngine,
    source: int,
    load: LoadProcess,
    peer_url: str | None,
    peer_http: httpx.AsyncClient,
    nbytes: int,
    left: list[int],
    builds: list[BuildRow],
) -> list[TransferRow]:
    window = window_for(nbytes, config.transfer_requests)
    count = config.transfer_requests
    raw: dict[int, list[float]] = {tp: [] for tp in config.tps}
    peer: dict[int, list[float]] = {tp: [] for tp in config.tps}
    served: dict[tuple[int, bool], list[float]] = {}
    registrations: dict[tuple[int, bool], float] = {}
    repeats: dict[tuple[int, bool], list[float]] = {}
    async with AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(
                _sized_server(engine, nbytes, arena=arena, window=window)
            )
            for arena in config.arena_modes
        ]
        others = []
        if config.baseline is not None:
            for build in (Build.this(), Build.at(config.baseline)):
                progress.say(f"transfer {size_text(nbytes)}: starting {build.name}'s server")
                others.append(
                    await stack.enter_async_context(_build_server(build, nbytes, progress))
                )
        compared: dict[int, list[tuple[float, float, float, float]]] = {tp: [] for tp in config.tps}
        for round_ in range(config.rounds):
            for tp in config.tps:
                name = f"{size_text(nbytes)} TP={tp} round {round_ + 1}/{config.rounds}"
                progress.say(f"transfer {name}: raw")
                raw[tp].append(await raw_transfers(engine, source, load.ranks[:tp], nbytes, count))
                for server in servers:
                    progress.say(f"transfer {name}: served, arena {_on(server.arena)}")
                    req_ids = [f"b{round_}-{tp}-{nbytes}-{i}" for i in range(count)]
                    before = await server.value("registrations_total")
                    seconds = await served_sends(
                        server.client, load, server.running.url, tp, req_ids, nbytes
                    )
                    made = await server.value("registrations_total") - before
                    key = (tp, server.arena)
                    served.setdefault(key, []).append(seconds)
                    registrations[key] = registrations.get(key, 0.0) + made
                    progress.say(f"transfer {name}: the same sends again (repeats)")
                    landed = await server.value("transfer_bytes_total")
                    repeats.setdefault(key, []).append(
                        await load.sends(server.running.url, req_ids, tp)
                    )
                    if await server.value("transfer_bytes_total") != landed:
                        raise RuntimeError("a repeated /send moved bytes: the http ms are wrong")
                if others:
                    seconds_cpu: list[tuple[float, float]] = []
                    # Alternate which build goes first, round by round.
                    for process, client in others[:: 1 if round_ % 2 == 0 else -1]:
                        url = f"http://127.0.0.1:{process.port}"
                        progress.say(f"transfer {name}: {process.name}")
                        req_ids = [
                            f"c{round_}-{tp}-{nbytes}-{i}-{process.name}" for i in range(count)
                        ]
                        before = process.cpu_seconds()
                        seconds = await served_sends(client, load, url, tp, req_ids, nbytes)
                        seconds_cpu.append((seconds, process.cpu_seconds() - before))
                    if round_ % 2:
                        seconds_cpu.reverse()
                    compared[tp].append((*seconds_cpu[0], *seconds_cpu[1]))
                if peer_url is not None:
                    progress.say(f"transfer {name}: peer")
                    req_ids = [f"p{round_}-{tp}-{nbytes}-{i}" for i in range(count)]
                    peer[tp].append(
                        await peer_sends(peer_http, load, peer_url, tp, req_ids, nbytes)
                    )
        for server in servers:
            registrations_left, scopes_left = await _leftovers(server)
            left[0] += registrations_left
            left[1] += scopes_left
    rows = []
    for tp in config.tps:
        moved = config.rounds * count * tp * nbytes
        if others:
            pairs = compared[tp]
            builds.append(
                BuildRow(
                    nbytes=nbytes,
                    tp=tp,
                    this=Rate(moved, sum(p[0] for p in pairs)),
                    baseline=Rate(moved, sum(p[2] for p in pairs)),
                    this_cpu_seconds=sum(p[1] for p in pairs),
                    baseline_cpu_seconds=sum(p[3] for p in pairs),
                    transfers=config.rounds * count * tp,
                    this_rates=tuple(count * tp * nbytes / p[0] for p in pairs),
                    baseline_rates=tuple(count * tp * nbytes / p[2] for p in pairs),
                )
            )
        for arena in config.arena_modes:
            rows.append(
                TransferRow(
                    nbytes=nbytes,
                    tp=tp,
                    arena=arena,
                    raw=Rate(moved, sum(raw[tp])),
                    served=Rate(moved, sum(served[tp, arena])),
                    peer=Rate(moved, sum(peer[tp])) if peer_url is not None else None,
                    registrations_per_request=registrations[tp, arena] / (config.rounds * count),
                    sends_per_rank=config.rounds * count,
                    repeat_seconds=sum(repeats[tp, arena]),
                )
            )
    return rows


def _on(flag: bool) -> str:
    return "on" if flag else "off"


async def _deregister(engine: MooncakeEngine, address: int) -> None:
    """Cleanup that a cancelled bench must still finish."""
    with trio.CancelScope(shield=True):
        await engine.deregister(address)


def _prepared(model: VisionModel, jpegs: list[bytes], max_pixels: int) -> list[Prepared]:
    """In a worker thread: images as the server prepares them, for the raw forward."""
    return [model.decode(jpeg, max_pixels=max_pixels) for jpeg in jpegs]


async def _encoder_rows(
    config: BenchConfig, progress: Progress
) -> tuple[str, EncoderRow, ProbeRow, tuple[int, int], VideoRow | None]:
    """The model's forward against /encode; the encoder rows' server has the cache off. With
    ``config.vlm`` the model is a small Qwen2.5-VL-shaped one, saved into a temporary
    directory, the images a mix of sizes, and a video row follows. The directory lives until
    the rows end: the server's settings name it, and settings check that their model
    directory exists."""
    settings = replace(
        config.encoder,
        cache_bytes=0,
        queue_size=max(config.encoder.queue_size, config.concurrency),
        warmup=True,
    )
    if not config.vlm:
        backend = await trio.to_thread.run_sync(load_backend, settings)
        return (*await _measure_encoder(config, progress, settings, backend, ()), None)
    from trio_encode.testing.tiny_vlm import VLM_IMAGE_SIZES, save_tiny_qwen2_5_vl

    with tempfile.TemporaryDirectory(prefix="trio-encode-bench-vlm-") as name:
        directory = Path(name)
        progress.say(f"encoder: saving a small Qwen2.5-VL-shaped model into {directory}")
        await trio.to_thread.run_sync(save_tiny_qwen2_5_vl, directory)
        settings = replace(settings, model=directory)
        backend = await trio.to_thread.run_sync(load_backend, settings)
        rows = await _measure_encoder(config, progress, settings, backend, VLM_IMAGE_SIZES)
        video = await _video_row(config, progress, settings, backend)
        return (*rows, video)


async def _measure_encoder(
    config: BenchConfig,
    progress: Progress,
    settings: EncoderSettings,
    backend: VisionModel,
    sizes: tuple[tuple[int, int], ...],
) -> tuple[str, EncoderRow, ProbeRow, tuple[int, int]]:
    """The encoder rows of ``backend``, loaded from ``settings``; ``sizes``: the clients' mix of
    image sizes (empty: square images of the model's size)."""
    metrics = BatchRecorder()
    arena = Arena(settings.arena_bytes, cache_bytes=0) if settings.arena_bytes else None
    encoder = ImageEncoder(backend, settings, observer=metrics, arena=arena)
    engine = await MooncakeEngine.create(config.engine)
    batch_size = settings.max_batch_size
    side = encoder.info.image_size or 224
    jpegs = mixed_jpegs(batch_size, sizes) if sizes else natural_jpegs(batch_size, side)
    batch = await trio.to_thread.run_sync(
        partial(_prepared, backend, jpegs, settings.max_image_pixels)
    )
    # The clients send every size of the mix, whatever B: their landing slots must take the
    # largest image, which a batch smaller than the mix leaves out.
    every_size = batch
    if len(sizes) > batch_size:
        every_size = await trio.to_thread.run_sync(
            partial(_prepared, backend, mixed_jpegs(len(sizes), sizes), settings.max_image_pixels)
        )
    bytes_per_image = max(encoder.keeper.row_bytes(image.tokens) for image in every_size)
    raw_images, raw_seconds, raw_rates = 0, 0.0, []
    rounds: list[ServedRound] = []
    latencies: list[float] = []
    statuses: list[int] = []
    server_settings = ServerSettings.exactly(port=0, encoder=settings, shutdown_grace=5.0)
    async with open_server(server_settings, engine=engine, encoder=encoder, metrics=metrics) as (
        running
    ):
        load_config = LoadConfig(
            url=running.url,
            concurrency=config.concurrency,
            tp=config.encoder_tp,
            image_size=side,
            bytes_per_image=bytes_per_image,
            engine=config.engine,
            nice=config.load_nice,
            image_sizes=sizes,
        )
        async with open_load(load_config) as load, EncodeClient(running.url) as client:
            for round_ in range(config.rounds):
                progress.say(f"encoder round {round_ + 1}/{config.rounds}: raw forward")
                images, seconds = await trio.to_thread.run_sync(
                    partial(raw_forward_for, backend, batch, config.raw_seconds / config.rounds)
                )
                raw_images, raw_seconds = raw_images + images, raw_seconds + seconds
                raw_rates.append(images / seconds)
                progress.say(f"encoder round {round_ + 1}/{config.rounds}: served")
                rounds.append(
                    await served_encode_round(
                        running.url,
                        metrics,
                        load,
                        seconds=config.served_seconds / config.rounds,
                        settle=config.settle_seconds,
                        probe_interval=config.probe_interval,
                        latencies=latencies,
                        statuses=statuses,
                    )
                )
            text = await client.metrics()
            left = (
                int(metric_value(text, "live_registrations")) - (arena is not None),
                int(metric_value(text, "live_scopes")),
            )
    batches = [batch for served in rounds for batch in served.batches]
    row = EncoderRow(
        batch_size=batch_size,
        concurrency=config.concurrency,
        raw_images=raw_images,
        raw_seconds=raw_seconds,
        served_images=sum(r.images for r in rounds),
        served_seconds=sum(r.seconds for r in rounds),
        served_batches=len(batches),
        served_forward_seconds=sum(seconds for _, seconds in batches),
        served_images_in_batches=sum(images for images, _ in batches),
        raw_spread=spread(raw_rates),
        served_spread=spread([r.images / r.seconds for r in rounds if r.seconds > 0]),
        mean_image_bytes=load.mean_image_bytes,
        mean_tokens=sum(image.tokens for image in batch) / len(batch),
    )
    probe = ProbeRow(
        interval=config.probe_interval,
        probes=len(statuses),
        ok=sum(status == 200 for status in statuses),
        p99_seconds=percentile(latencies, 0.99),
        max_seconds=max(latencies, default=0.0),
    )
    return backend.model_id, row, probe, left


def _raw_videos(
    path: VideoPath, videos: Sequence[PreparedVideo], seconds: float
) -> tuple[int, float]:
    """In a worker thread: videos and seconds of back-to-back forwards of the video path, one
    of ``videos`` each, in turn, for at least ``seconds`` (at least one), after one untimed.
    On a GPU each forward is waited for, as the served path waits for each batch's rows."""
    device = path.vlm.device

    def forward(video: PreparedVideo) -> None:
        path.features([video])
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    forward(videos[0])
    start = time.perf_counter()
    count = 0
    while True:
        forward(videos[count % len(videos)])
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count, elapsed


_DECODES = 4
"""Decodings of the video timed in each round of the video row."""


def _decodes(path: VideoPath, videos: Sequence[bytes], count: int) -> float:
    """In a worker thread: seconds of ``count`` decodings of ``videos`` in turn as the server
    decodes a video (its frames chosen, then prepared for the model), one after another."""
    start = time.perf_counter()
    for index in range(count):
        path.prepare(decode_video(videos[index % len(videos)], path.sampling))
    return time.perf_counter() - start


async def _served_video(encoder: ImageEncoder, item: str) -> None:
    """One ``VIDEO`` part of ``item`` (a data URI) as the service serves it."""
    items = await encoder.load_items([item], "VIDEO")
    (await encoder.encode(items, "VIDEO")).release()


async def _served_videos(
    encoder: ImageEncoder, items: Sequence[str], seconds: float
) -> tuple[int, float]:
    """Videos and seconds of one task per item, each serving its own in a loop for
    ``seconds`` (the parts begun by then are finished and counted)."""
    done = 0
    start = time.perf_counter()

    async def call(item: str) -> None:
        nonlocal done
        while time.perf_counter() - start < seconds:
            await _served_video(encoder, item)
            done += 1

    async with trio.open_nursery() as nursery:
        for item in items:
            nursery.start_soon(call, item)
    return done, time.perf_counter() - start


async def _video_row(
    config: BenchConfig, progress: Progress, settings: EncoderSettings, backend: VisionModel
) -> VideoRow:
    """The bench's video through the encoder the service uses against the model's video
    path on the same prepared frames, one video a forward; the phases alternate round by
    round, as the image rows' do."""
    progress.say(f"video: writing {config.concurrency} videos")
    datas = await trio.to_thread.run_sync(bench_videos, config.concurrency)
    items = ["data:video/mp4;base64," + base64.b64encode(data).decode() for data in datas]
    arena = Arena(settings.arena_bytes, cache_bytes=0) if settings.arena_bytes else None
    metrics = BatchRecorder()
    encoder = ImageEncoder(backend, settings, observer=metrics, arena=arena)
    path = encoder.batcher.video
    if path is None:
        raise RuntimeError(f"{backend.model_id} has no video path: no video row")
    decoded = [await trio.to_thread.run_sync(decode_video, data, path.sampling) for data in datas]
    prepared = [await trio.to_thread.run_sync(path.prepare, video) for video in decoded]
    raw_videos, raw_seconds, raw_rates = 0, 0.0, []
    served_videos, served_seconds, served_rates = 0, 0.0, []
    decode_seconds = 0.0
    batches: list[tuple[int, float]] = []
    frames = len(decoded[0].indices)
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        # The video path's first forward, untimed (the encoder's warm-up runs images only).
        await _served_video(encoder, items[0])
        for round_ in range(config.rounds):
            name = f"video round {round_ + 1}/{config.rounds}"
            progress.say(f"{name}: raw forward")
            videos, seconds = await trio.to_thread.run_sync(
                _raw_videos, path, prepared, config.raw_seconds / config.rounds
            )
            raw_videos, raw_seconds = raw_videos + videos, raw_seconds + seconds
            raw_rates.append(videos * frames / seconds)
            progress.say(f"{name}: served")
            metrics.batches.clear()
            videos, seconds = await _served_videos(
                encoder, items, config.served_seconds / config.rounds
            )
            served_videos, served_seconds = served_videos + videos, served_seconds + seconds
            served_rates.append(videos * frames / seconds)
            batches += metrics.batches
            progress.say(f"{name}: decoding")
            decode_seconds += await trio.to_thread.run_sync(_decodes, path, datas, _DECODES)
        nursery.cancel_scope.cancel()
    return VideoRow(
        batch_size=settings.max_batch_size,
        concurrency=config.concurrency,
        frames=frames,
        tokens=prepared[0].tokens,
        video_bytes=len(datas[0]),
        raw_videos=raw_videos,
        raw_seconds=raw_seconds,
        served_videos=served_videos,
        served_seconds=served_seconds,
        served_batches=len(batches),
        served_videos_in_batches=sum(videos for videos, _ in batches),
        served_forward_seconds=sum(seconds for _, seconds in batches),
        decode_videos=_DECODES * config.rounds,
        decode_seconds=decode_seconds,
        raw_spread=spread(raw_rates),
        served_spread=spread(served_rates),
    )


async def run_bench(config: BenchConfig) -> BenchResult:
    """Every row; see the module's doc."""
    started = time.perf_counter()
    progress = Progress(config.progress)
    transfers: list[TransferRow] = []
    builds: list[BuildRow] = []
    registrations_left = scopes_left = 0
    calls = await run_calls(config, progress) if config.http else None
    if not config.vlm and not config.http:
        transfers, registrations_left, scopes_left = await _transfer_rows(config, progress, builds)
    model_id, encoder, health, video = "", None, None, None
    if (config.encoder_rows or config.vlm) and not config.http:
        model_id, encoder, health, left, video = await _encoder_rows(config, progress)
        registrations_left += left[0]
        scopes_left += left[1]
    result = BenchResult(
        model_id=model_id,
        rounds=config.rounds,
        torch_threads=torch.get_num_threads(),
        transfers=transfers,
        encoder=encoder,
        health=health,
        peak_rss_bytes=_peak_rss(),
        registrations_left=registrations_left,
        scopes_left=scopes_left,
        seconds=time.perf_counter() - started,
        calls=calls,
        builds=builds,
        video=video,
    )
    if config.plots is not None:
        from trio_encode.tools.bench.plots import write_plots

        for path in write_plots(result, config.plots):
            progress.say(f"wrote {path}")
    return result
