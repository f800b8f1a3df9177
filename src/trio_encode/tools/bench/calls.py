"""The HTTP rows of ``trio-encode bench --http``: calls per second per route, and the server CPU
each call costs, for our server beside the floor of its fixed stack and an SGLang-style server.

SGLang's encode path costs 1 + 2 x TP HTTP calls per image part (``/encode``, then every rank's
metadata pull and ``/send``), so the calls a process answers per second bound the images per
second it can feed, whatever its GPU does. Every server is a process of its own started here
(:mod:`trio_encode.tools.bench.servers`): ours with a stand-in encoder and an in-memory engine
(only HTTP and the service run; ``/send`` is answered as a repeat, since a part has a bounded
number of receivers), hypercorn's Trio worker with a one-line ASGI app (the floor), and a
FastAPI/uvicorn handler; with ``--baseline`` also ours from another build. The same raw
keep-alive clients (``http_clients`` processes x ``http_connections`` connections) call one
server at a time; servers alternate within each round and rounds are pooled, so load that comes
and goes skews every side alike. Server CPU is read from ``/proc/PID/stat`` (every thread of
the process: the log writer's too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

import trio_encode
from trio_encode.tools.bench import servers
from trio_encode.tools.bench.phases import Progress
from trio_encode.tools.bench.settings import FLOOR_TARGET, PEER_TARGET, BenchConfig
from trio_encode.tools.children import Lines, stop

ROUTES = ("pull", "send", "health", "encode")
"""The measured routes, by the names :func:`~trio_encode.tools.bench.servers.route_request`
knows; pulls, ``/send`` and ``/health`` carry the targets."""
TARGETED = frozenset({"pull", "send", "health"})
_SCRIPT = Path(servers.__file__)
_TICKS = os.sysconf("SC_CLK_TCK")
_STARTUP_SECONDS = 120
"""How long a server process may take to say its port (imports on a busy 2-core box)."""


@dataclass(frozen=True)
class Build:
    """Which ``trio_encode`` a server process runs: an interpreter and a ``PYTHONPATH``."""

    name: str
    python: str
    path: str | None

    @classmethod
    def this(cls) -> Build:
        """This process's build (its interpreter, its source tree first on the path)."""
        return cls("this build", sys.executable, str(Path(trio_encode.__file__).parents[1]))

    @classmethod
    def at(cls, where: Path) -> Build:
        """``where``: a source tree (``src/trio_encode`` or ``trio_encode`` inside), run by this
        interpreter, or an interpreter whose environment has the build installed."""
        for tree in (where / "src", where):
            if (tree / "trio_encode" / "__init__.py").is_file():
                return cls(f"baseline {where}", sys.executable, str(tree.resolve()))
        if where.is_file() and os.access(where, os.X_OK):
            return cls(f"baseline {where}", str(where), None)
        raise ValueError(
            f"--baseline {where}: neither a source tree (with src/trio_encode) nor an interpreter"
        )

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if self.path is not None:
            env["PYTHONPATH"] = self.path
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        return env


@dataclass
class ServerProcess:
    """A started server: its name in the table, its process and what it said when ready."""

    name: str
    process: trio.Process
    ready: dict[str, Any]

    @property
    def port(self) -> int:
        return int(self.ready["port"])

    def cpu_seconds(self) -> float:
        """User and system CPU of every thread of the process so far."""
        with open(f"/proc/{self.process.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS


@asynccontextmanager
async def open_server(
    name: str, args: Sequence[str], build: Build | None = None
) -> AsyncIterator[ServerProcess]:
    """Start ``servers.py ARGS`` under ``build`` (this one by default); stop it on the way out
    (its stdin closes; SIGTERM if it lingers). Its stderr (the access log) goes to /dev/null:
    formatted and written, as a server's would be, read by nobody."""
    build = build or Build.this()
    process = await trio.lowlevel.open_process(
        [build.python, str(_SCRIPT), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=build.env(),
    )
    assert process.stdin is not None
    assert process.stdout is not None
    try:
        with trio.fail_after(_STARTUP_SECONDS):
            line = await Lines(process.stdout).next()
        if line is None:
            await process.wait()
            raise RuntimeError(
                f"the {name} server ({build.name}: {' '.join(args)}) exited with "
                f"{process.returncode} before it listened"
            )
        yield ServerProcess(name, process, json.loads(line))
    finally:
        with trio.CancelScope(shield=True):
            await process.stdin.aclose()
            with trio.move_on_after(10):
                await process.wait()
            await stop(process, grace=5)
            await process.stdout.aclose()


class Clients:
    """The client processes; each call of :meth:`run` has all of them call one route at once."""

    def __init__(self, processes: list[tuple[trio.Process, Lines]], connections: int) -> None:
        self._processes = processes
        self._connections = connections

    async def run(self, server: ServerProcess, route: str, seconds: float) -> tuple[int, float]:
        """Calls answered 200 and the longest client's seconds; any other answer fails the run
        (a server answering errors fast is not a fast server)."""
        command = {
            "port": server.port,
            "route": route,
            "seconds": seconds,
            "connections": self._connections,
            "session_id": server.ready.get("session_id", ""),
            "buffer_address": server.ready.get("buffer_address", 0),
        }
        answers: list[dict[str, Any]] = []

        async def one(process: trio.Process, lines: Lines) -> None:
            assert process.stdin is not None
            await process.stdin.send_all(json.dumps(command).encode() + b"\n")
            line = await lines.next()
            if line is None:
                raise RuntimeError("a client process ended")
            answers.append(json.loads(line))

        async with trio.open_nursery() as nursery:
            for process, lines in self._processes:
                nursery.start_soon(one, process, lines)
        failures = [failure for answer in answers for failure in answer["failures"]]
        if failures:
            raise RuntimeError(f"calling {route} on {server.name}: {failures[0]}")
        errors = sum(answer["errors"] for answer in answers)
        if errors:
            raise RuntimeError(f"{server.name} answered {route} with {errors} non-200 answers")
        return sum(a["calls"] for a in answers), max(a["seconds"] for a in answers)


@asynccontextmanager
async def open_clients(count: int, connections: int) -> AsyncIterator[Clients]:
    async with AsyncExitStack() as stack:
        processes = []
        for _ in range(count):
            process = await trio.lowlevel.open_process(
                [sys.executable, str(_SCRIPT), "client"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            stack.push_async_callback(_stop_client, process)
            assert process.stdout is not None
            lines = Lines(process.stdout)
            if await lines.next() is None:
                raise RuntimeError("a client process did not start")
            processes.append((process, lines))
        yield Clients(processes, connections)


async def _stop_client(process: trio.Process) -> None:
    with trio.CancelScope(shield=True):
        assert process.stdin is not None
        assert process.stdout is not None
        await process.stdin.aclose()
        await stop(process, grace=5)
        await process.stdout.aclose()


@dataclass
class CallsRow:
    """One route on one server, pooled over the rounds."""

    route: str
    server: str
    calls: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    rates: list[float] = field(default_factory=list)
    """Calls/s of each round (their spread shows the noise)."""

    @property
    def per_second(self) -> float:
        return self.calls / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us_per_call(self) -> float:
        """Server CPU per call, in microseconds."""
        return 1e6 * self.cpu_seconds / self.calls if self.calls else 0.0


@dataclass(frozen=True)
class CallsResult:
    """Every route on every server; ``servers`` in the order the table shows them."""

    rows: list[CallsRow]
    servers: tuple[str, ...]
    rounds: int
    clients: int
    connections: int
    seconds: float

    def row(self, route: str, server: str) -> CallsRow:
        return next(r for r in self.rows if r.route == route and r.server == server)

    def ratios(self, route: str) -> dict[str, float]:
        """``ours CPU/call over the floor's`` (target <= FLOOR_TARGET), ``ours calls/s over
        sglang's`` (target >= PEER_TARGET), and against the baseline when there is one."""
        ours = self.row(route, "ours")
        out: dict[str, float] = {}
        for other, rate_key, cpu_key in (
            ("floor", None, "cpu_over_floor"),
            ("sglang", "rate_over_sglang", None),
            ("baseline", "rate_over_baseline", "cpu_over_baseline"),
        ):
            if other not in self.servers:
                continue
            row = self.row(route, other)
            if rate_key is not None and row.per_second:
                out[rate_key] = ours.per_second / row.per_second
            if cpu_key is not None and row.cpu_us_per_call:
                out[cpu_key] = ours.cpu_us_per_call / row.cpu_us_per_call
        return out

    def table(self) -> str:
        lines = [
            "",
            f"HTTP calls: {self.clients} client processes x {self.connections} keep-alive "
            f"connections, {self.rounds} alternating rounds of {self.seconds:g} s per route "
            "and server",
            "  floor: hypercorn (trio) with a one-line ASGI app; sglang: a FastAPI/uvicorn "
            "handler; ours: stand-in encoder and engine, access log on",
            f"  targets (pull, send, health): CPU/call within {FLOOR_TARGET}x the floor's; "
            f"calls/s >= {PEER_TARGET} of sglang's",
            f"{'route':>8}{'server':>10}{'calls/s':>10}{'rounds':>18}{'us CPU/call':>13}",
        ]
        for route in ROUTES:
            for server in self.servers:
                row = self.row(route, server)
                spread = f"{min(row.rates):.0f}..{max(row.rates):.0f}" if row.rates else "-"
                lines.append(
                    f"{route:>8}{server:>10}{row.per_second:>10.0f}{spread:>18}"
                    f"{row.cpu_us_per_call:>13.0f}"
                )
            ratios = self.ratios(route)
            lines.append(f"{'':>8}{'ratios':>10}  " + _ratio_text(route, ratios))
        return "\n".join(lines)


def _ratio_text(route: str, ratios: dict[str, float]) -> str:
    parts = []
    for key, label in (
        ("cpu_over_floor", "CPU/call over floor"),
        ("rate_over_sglang", "calls/s over sglang"),
        ("rate_over_baseline", "calls/s over baseline"),
        ("cpu_over_baseline", "CPU/call over baseline"),
    ):
        if key in ratios:
            verdict = ""
            if route in TARGETED and key == "cpu_over_floor":
                verdict = " (meets)" if ratios[key] <= FLOOR_TARGET else " (above target)"
            if route in TARGETED and key == "rate_over_sglang":
                verdict = " (meets)" if ratios[key] >= PEER_TARGET else " (below target)"
            parts.append(f"{label} {ratios[key]:.2f}{verdict}")
    return "; ".join(parts) or "-"


async def run_calls(config: BenchConfig, progress: Progress) -> CallsResult:
    """Every route on every server, rounds alternating; see the module's doc."""
    kinds: list[tuple[str, list[str], Build | None]] = [
        ("ours", ["ours"], None),
        ("floor", ["floor"], None),
        ("sglang", ["sglang"], None),
    ]
    if config.baseline is not None:
        kinds.append(("baseline", ["ours"], Build.at(config.baseline)))
    async with AsyncExitStack() as stack:
        started = []
        for name, args, build in kinds:
            progress.say(f"HTTP calls: starting the {name} server")
            started.append(await stack.enter_async_context(open_server(name, args, build)))
        clients = await stack.enter_async_context(
            open_clients(config.http_clients, config.http_connections)
        )
        rows = {(route, s.name): CallsRow(route, s.name) for route in ROUTES for s in started}
        for round_ in range(config.rounds):
            for route in ROUTES:
                # Each round starts with another server, so none always runs first or last.
                order = started[round_ % len(started) :] + started[: round_ % len(started)]
                for server in order:
                    progress.say(
                        f"HTTP calls round {round_ + 1}/{config.rounds}: {route}, {server.name}"
                    )
                    before = server.cpu_seconds()
                    calls, seconds = await clients.run(server, route, config.http_seconds)
                    row = rows[route, server.name]
                    row.cpu_seconds += server.cpu_seconds() - before
                    row.calls += calls
                    row.seconds += seconds
                    row.rates.append(calls / seconds)
    return CallsResult(
        rows=list(rows.values()),
        servers=tuple(s.name for s in started),
        rounds=config.rounds,
        clients=config.http_clients,
        connections=config.http_connections,
        seconds=config.http_seconds,
    )
