"""``trio-encode fleet``: a Mooncake master, several encoders, TP ranks, one encoder killed.

The smallest cluster that shows what the fleet features are for. A ``mooncake_master`` and N
``trio-encode serve --store-master`` processes start on loopback; in this process, TP prefill
ranks (each with its own Mooncake engine, landing pool and :class:`FleetClient`) run a workload
in which every image is asked for several times. Half-way through, one encoder is killed.

What it shows, in the printed table:

- every rank of every request is served (the ranks fail over), and every copy of an image is
  the same bytes, checked on landing, whichever encoder served it;
- forwards run come to about the number of distinct images: content-affinity routing sends
  repeats to the encoder that already holds them, and after the kill their new encoder finds
  them in the store. ``--route-by request`` (no affinity) and ``--no-store`` show the
  alternatives for comparison.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import httpx
import trio
from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass as settings_dataclass

from trio_encode.declare import SETTINGS, in_group
from trio_encode.encoder import EncoderSettings
from trio_encode.settings import ServerSettings, child_environment, serve_flags, server_settings
from trio_encode.tools.children import stop

if TYPE_CHECKING:
    from trio_encode.client import FleetClient, LandingPool
    from trio_encode.tools.progress import Steps

RouteBy = Literal["content", "request"]
"""How the ranks' clients pick an encoder: :data:`trio_encode.client.fleet.RouteBy`, restated
because importing the client imports torch, which ``trio-encode fleet --help`` must not."""

_SLOT_BYTES = 16 << 20  # room for one request's embedding per concurrent request and rank
_POOL_SLOTS = 2  # per concurrent request: a send cut off by the kill quarantines its slot
_STORE_SEGMENT_BYTES = 256 << 20  # each encoder's share of the store


fleet_setting = in_group("fleet")


@settings_dataclass(frozen=True, config=SETTINGS)
class FleetDemoConfig:
    """The fleet's size and workload (flags of ``trio-encode fleet``), and what its encoders
    are started with."""

    encoders: int = fleet_setting(3, gt=0)
    """Encode servers."""
    ranks: int = fleet_setting(4, gt=0)
    """TP prefill ranks."""
    requests: int = fleet_setting(48, gt=0)
    """Requests to run."""
    distinct: int = fleet_setting(12, gt=0)
    """Distinct images the requests draw from (each is asked for repeatedly)."""
    concurrency: int = fleet_setting(4, gt=0)
    """Requests in flight at once."""
    kill: bool = fleet_setting(True)
    """Kill one encoder once half of the requests are done."""
    store: bool = fleet_setting(True)
    """Start a mooncake_master and share embeddings through Mooncake Store."""
    progress: bool = fleet_setting(True)
    """Show progress on stderr while it runs."""
    route_by: RouteBy = fleet_setting("content")
    """content: the images pick the encoder; request: the req_id does (no affinity, for
    comparison)."""
    encoder: EncoderSettings = Field(default_factory=lambda: EncoderSettings(torch_threads=1))
    """The model every encoder runs (one torch thread each: they share the machine)."""
    send_timeout: float = 10.0
    """Every encoder's ``send_timeout``: a rank whose encoder was killed gives up soon."""
    shutdown_grace: float = 2.0

    @model_validator(mode="after")
    def _servers_start(self) -> FleetDemoConfig:
        self.server(port=0, store_master=None)  # refused here, before anything starts
        return self

    def server(self, *, port: int, store_master: str | None) -> ServerSettings:
        """The settings of one encoder (its flags: :func:`~trio_encode.settings.serve_flags`)."""
        store = {"store_master": store_master, "store_segment_bytes": _STORE_SEGMENT_BYTES}
        return server_settings(
            port=port,
            log_level="WARNING",
            send_timeout=self.send_timeout,
            shutdown_grace=self.shutdown_grace,
            encoder=self.encoder,
            **(store if store_master else {}),
        )


@dataclass
class EncoderCounts:
    """One encoder's counters and whether it was killed."""

    url: str
    counts: dict[str, float] = field(default_factory=dict)
    """By field of :data:`COLUMNS` (0 until counted): ``served`` counted from the ranks, the
    rest read from its ``/metrics``."""
    killed: bool = False

    def count(self, name: str) -> float:
        return self.counts.get(name, 0.0)


COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("served", "served", "rank-requests it answered; each one's bytes landed and were checked"),
    ("forwards", "forwards", "images its model ran (an image found in a cache runs none)"),
    ("local hits", "local_hits", "images found in its own embedding cache"),
    ("store hits", "store_hits", "images read from Mooncake Store, put there by an encoder"),
    ("store misses", "store_misses", "images the store did not hold yet: computed, then offered"),
    (
        "store failed",
        "store_failures",
        "store lookups that failed (an error, e.g. an entry held in the killed encoder's "
        "memory; a timeout; no connection yet): the image was computed instead, so no rank "
        "saw it",
    ),
)
"""The table's counters: header, field of :attr:`EncoderCounts.counts`, what it counts."""


@dataclass
class FleetOutcome:
    config: FleetDemoConfig
    rows: list[EncoderCounts] = field(default_factory=list)
    served: int = 0
    bytes_checked: int = 0
    failovers: int = 0
    seconds: float = 0.0
    logs: Path | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def forwards(self) -> float:
        return sum(row.count("forwards") for row in self.rows)

    def table(self) -> str:
        """Per encoder, its counters and state; the totals; what each counter means; the
        verdict."""
        c = self.config
        widths = [max(8, len(header) + 1) for header, _, _ in COLUMNS]
        head = f"{'encoder':<24}" + "".join(
            f" {header:>{w}}" for (header, _, _), w in zip(COLUMNS, widths, strict=True)
        )
        head += "  state"

        def line(name: str, values: list[float], state: str) -> str:
            cells = "".join(f" {value:>{w}.0f}" for value, w in zip(values, widths, strict=True))
            return f"{name:<24}{cells}  {state}".rstrip()

        lines = [head, "-" * len(head)]
        for row in self.rows:
            state = "killed half-way (counts at the kill)" if row.killed else "up"
            values = [row.count(name) for _, name, _ in COLUMNS]
            lines.append(line(row.url.removeprefix("http://"), values, state))
        totals = [sum(row.count(name) for row in self.rows) for _, name, _ in COLUMNS]
        lines += ["-" * len(head), line("total", totals, "")]
        lines += [""] + [f"{header:>14}: {meaning}" for header, _, meaning in COLUMNS]
        lines += [
            "",
            f"routing by {c.route_by}, store {'on' if c.store else 'off'}: "
            f"{c.requests} requests x {c.ranks} ranks over {c.encoders} encoders, "
            f"{c.distinct} distinct images, in {self.seconds:.1f} s",
            f"requests served {self.served} of {c.requests * c.ranks} rank-requests; "
            f"bytes checked {self.bytes_checked / 1e6:.1f} MB; failovers {self.failovers} "
            "(a rank's request retried on the next encoder)",
            f"forwards run {self.forwards:.0f} for {c.distinct} distinct images",
        ]
        lines += [f"FAILED: {failure}" for failure in self.failures]
        if self.failures and self.logs is not None:
            lines.append(f"server logs: {self.logs}")
        lines.append("OK: every rank served, every byte checked" if self.ok else "fleet FAILED")
        return "\n".join(lines)


def _executable(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError(f"{name} not found: it ships with `pip install 'trio-encode[mooncake]'`")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@asynccontextmanager
async def _process(command: list[str], log: Path) -> AsyncIterator[trio.Process]:
    """A child process for the body of the ``async with``; killed on the way out."""
    env = child_environment({"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")})
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            command, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        yield process
    finally:
        await stop(process, grace=5)


async def _until(
    what: str, within: float, process: trio.Process, check: Callable[[], Awaitable[bool]]
) -> None:
    with trio.move_on_after(within):
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited with {process.returncode}")
            try:
                if await check():
                    return
            except (OSError, httpx.HTTPError):
                pass
            await trio.sleep(0.2)
    raise RuntimeError(f"{what} was not ready within {within:.0f} s")


async def run_fleet_demo(config: FleetDemoConfig) -> FleetOutcome:
    """Start the cluster, run the workload, stop everything; a start-up failure names the
    directory with the processes' logs."""
    from trio_encode.tools.progress import Steps

    outcome = FleetOutcome(config, logs=Path(tempfile.mkdtemp(prefix="trio-encode-fleet-")))
    try:
        with Steps(config.progress) as steps:
            await _run_cluster(config, outcome, steps)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc} (logs in {outcome.logs})") from exc
    if outcome.ok and outcome.logs is not None:
        shutil.rmtree(outcome.logs, ignore_errors=True)  # kept only to explain a failure
        outcome.logs = None
    return outcome


async def _run_cluster(config: FleetDemoConfig, outcome: FleetOutcome, steps: Steps) -> None:
    from trio_encode.client import FleetClient, LandingPool, metric_value
    from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings

    assert outcome.logs is not None
    logs = outcome.logs
    async with AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=5))
        master_address: str | None = None
        if config.store:
            started = steps.begin("starting mooncake_master (the store's master)")
            port = _free_port()
            master = await stack.enter_async_context(
                _process(
                    [
                        _executable("mooncake_master"),
                        f"--rpc_port={port}",
                        "--rpc_address=127.0.0.1",
                        f"--metrics_port={_free_port()}",
                    ],
                    logs / "master.log",
                )
            )

            async def listening() -> bool:
                with trio.socket.socket() as sock:
                    await sock.connect(("127.0.0.1", port))
                return True

            await _until("mooncake_master", 20, master, listening)
            master_address = f"127.0.0.1:{port}"
            steps.finish(started)

        urls: list[str] = []
        processes: list[trio.Process] = []
        for n in range(config.encoders):
            port = _free_port()
            urls.append(f"http://127.0.0.1:{port}")
            processes.append(
                await stack.enter_async_context(
                    _process(
                        [
                            *(sys.executable, "-m", "trio_encode.cli", "serve"),
                            *serve_flags(config.server(port=port, store_master=master_address)),
                        ],
                        logs / f"encoder-{n}.log",
                    )
                )
            )
        starting = steps.begin(
            f"starting {config.encoders} encoders (each loads its model"
            + (", then joins the store)" if config.store else ")"),
            config.encoders,
        )
        for url, process in zip(urls, processes, strict=True):

            async def ready(url: str = url) -> bool:
                if (await http.get(url + "/health")).status_code != 200:
                    return False
                if not config.store:
                    return True
                text = (await http.get(url + "/metrics")).text
                return metric_value(text, "store_connected") == 1

            await _until(f"encoder {url}", 120, process, ready)
            steps.advance(starting)

        with steps.step(f"starting {config.ranks} ranks' Mooncake engines", config.ranks) as one:
            engines = []
            for _ in range(config.ranks):
                engines.append(await MooncakeEngine.create(MooncakeSettings()))
                one()
        pools = [
            await stack.enter_async_context(
                LandingPool.open(engine, _POOL_SLOTS * config.concurrency * _SLOT_BYTES)
            )
            for engine in engines
        ]
        clients = [
            await stack.enter_async_context(FleetClient.open(urls, route_by=config.route_by))
            for _ in range(config.ranks)
        ]
        await _workload(config, urls, processes, pools, clients, http, outcome, steps)
        for client in clients:
            outcome.failovers += client.stats.failovers


async def _workload(
    config: FleetDemoConfig,
    urls: list[str],
    processes: list[trio.Process],
    pools: list[LandingPool],
    clients: list[FleetClient],
    http: httpx.AsyncClient,
    outcome: FleetOutcome,
    steps: Steps,
) -> None:
    from trio_encode.client import ChecksumMismatch, LandingSlot
    from trio_encode.errors import RequestError
    from trio_encode.testing.images import noise_uri

    images = [noise_uri(seed, 224) for seed in range(config.distinct)]
    order = [n % config.distinct for n in range(config.requests)]
    random.Random(0).shuffle(order)
    checksums: dict[int, str] = {}
    rows = {url: EncoderCounts(url) for url in urls}
    outcome.rows = list(rows.values())
    limit = trio.Semaphore(config.concurrency)
    half = trio.Event()
    done = 0
    victim = urls[-1]

    async def rank_request(req: int, r: int) -> None:
        image = order[req]
        slot: LandingSlot | None = None
        try:
            result = await clients[r].encode_and_send(
                f"fleet-{req}", [images[image]], pool=pools[r], receive_count=config.ranks
            )
            slot = result.slot
            size = result.encoded.embedding_size
            slot.verify(size, result.encoded.checksum)
            if checksums.setdefault(image, result.encoded.checksum) != result.encoded.checksum:
                outcome.failures.append(f"image {image}: {result.encoder} sent other bytes")
            outcome.bytes_checked += size
            outcome.served += 1
            answered = rows[result.encoder]
            answered.counts["served"] = answered.count("served") + 1
        except (RequestError, ChecksumMismatch) as exc:
            outcome.failures.append(f"fleet-{req} rank {r}: {type(exc).__name__}: {exc}")
        finally:
            if slot is not None:
                slot.release()
            sent()

    async def request(req: int) -> None:
        nonlocal done
        async with limit, trio.open_nursery() as nursery:
            for r in range(config.ranks):
                nursery.start_soon(rank_request, req, r)
        done += 1
        if done == config.requests // 2:
            half.set()

    async def kill_half_way() -> None:
        await half.wait()
        await _read_counts(http, rows[victim])
        processes[-1].kill()
        rows[victim].killed = True
        steps.finish(steps.begin(f"killed encoder {victim.removeprefix('http://')} half-way"))

    started = trio.current_time()
    killing = config.kill and config.encoders > 1
    sending = f"/encode + /send from {config.ranks} ranks" + (
        ", one encoder killed half-way" if killing else ""
    )
    async with trio.open_nursery() as nursery:
        if killing:
            nursery.start_soon(kill_half_way)
        with steps.step(sending, config.requests * config.ranks) as sent:
            async with trio.open_nursery() as requests:
                for req in range(config.requests):
                    requests.start_soon(request, req)
        nursery.cancel_scope.cancel()
    outcome.seconds = trio.current_time() - started
    with steps.step("reading every encoder's counters"):
        for row in outcome.rows:
            if not row.killed:
                await _read_counts(http, row)


async def _read_counts(http: httpx.AsyncClient, row: EncoderCounts) -> None:
    from trio_encode.client import metric_value

    text = (await http.get(row.url + "/metrics")).text
    row.counts.update(
        forwards=metric_value(text, "encoder_batch_size_sum"),
        local_hits=metric_value(text, "encoder_cache_hits_total"),
        store_hits=metric_value(text, "store_lookups_total", result="hit"),
        store_misses=metric_value(text, "store_lookups_total", result="miss"),
        store_failures=sum(
            metric_value(text, "store_lookups_total", result=result)
            for result in ("error", "timeout", "unavailable")
        ),
    )
