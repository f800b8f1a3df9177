"""Walk one ``/encode`` and one ``/send`` through the package, and measure the middle floors.

``python tests/walks.py`` serves the small built-in ViT in-process (the real encoder, the
in-memory engine, or ``--engine mooncake`` for real Mooncake engines over loopback), sends an
untraced warm-up pair, then one ``/encode`` and one ``/send`` with every Python call profiled
(every thread's, so work handed to a worker thread is seen too). For each route it prints the
files of the package the call crossed, in order (consecutive calls in one file collapsed),
how many distinct files that is, and how many steps of that walk climb back up (go to a file
of a higher layer than the one before it: the layers are ``tests/test_layers.py``'s). A
coroutine resumed is not a call: only its first start counts. The same numbers are printed
without the observers, logs and metrics, and then how many lines some modules have and how
many pairs of places ``duplicates --min-lines 4`` finds in the core (all but tools/ and
testing/).

Run it against another tree with that tree's ``src`` first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import pairwise
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import torch
import trio

import trio_encode
from support.models import SMALL
from test_layers import RANK, unit_of
from trio_encode.encoder import ImageEncoder
from trio_encode.engine import TransferEngine
from trio_encode.server.serve import open_server
from trio_encode.settings import ServerSettings
from trio_encode.testing.images import noise_uri

PACKAGE = Path(trio_encode.__file__).resolve().parent
STAND_INS = {"testing/memory_engine.py": "engine", "ending.py": "request_state"}
"""Test doubles in the walk, placed in the layer of the part they stand in for (and a module
of older trees, in the layer of the one that replaced it)."""
OBSERVERS = frozenset({"logs.py", "server/metrics.py", "observer.py"})
"""Files that only watch a call (logs, metrics): the walk is also shown without them."""
MODULES = (
    "scope.py",
    "scopes.py",
    "ending.py",
    "request_state.py",
    "request_types.py",
    "service/*.py",
    "encoder/front.py",
    "encoder/batcher.py",
    "encoder/cache.py",
    "encoder/store.py",
    "arena.py",
    "embedding.py",
)
"""The modules whose lines are counted (a pattern under the package)."""
CORE_LEFT_OUT = ("tools", "testing")
CHAIN_TARGETS = ("scope", "engine", "encoder", "encoder/backend.py")
"""Units (or files) whose first call's stack is shown: a call's own path, without the other
tasks' interleaving. A handler reaches its scope; the scope's task the engine or the encoder;
the batcher's task the model."""


class Tracer:
    """Records, while :attr:`recording`, the package file of every Python call (not a
    resumption) on every thread, in the order they happen."""

    def __init__(self) -> None:
        self.recording = False
        self.calls: list[tuple[str | None, str]] = []
        """(the calling file when the caller is in the package too, the called file)"""
        self.chains: dict[str, list[str]] = {}
        """By target (see :data:`CHAIN_TARGETS`): the package files on the call stack
        (outermost first) of the first call into it, whichever task made it."""
        self._started: dict[int, FrameType] = {}  # kept alive so that no id is reused

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.recording:
            return
        path = frame.f_code.co_filename
        if not path.startswith(str(PACKAGE)):
            return
        if frame.f_code.co_flags & 0x2A0:  # a generator or coroutine: its first start only
            if id(frame) in self._started:
                return
            self._started[id(frame)] = frame
        caller = frame.f_back
        called = _package_file(path)
        self.calls.append((_package_file(caller.f_code.co_filename) if caller else None, called))
        unit = STAND_INS.get(called or "") or unit_of(
            "trio_encode." + (called or "").removesuffix(".py").replace("/", ".")
        )
        target = called if called in CHAIN_TARGETS else unit
        if target in CHAIN_TARGETS and target not in self.chains:
            self.chains[target] = _stack(frame)

    def install(self) -> None:
        threading.setprofile(self)
        sys.setprofile(self)

    def remove(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        self._started.clear()

    async def trace(self, action: Callable[[], Any]) -> list[tuple[str | None, str]]:
        """The calls ``action()`` (awaited) makes, and every task's while it runs."""
        self.calls = []
        self.chains = {}
        self.recording = True
        try:
            await action()
        finally:
            self.recording = False
        return self.calls


def _package_file(path: str) -> str | None:
    """``path`` relative to the package (None: not in it)."""
    return Path(path).relative_to(PACKAGE).as_posix() if path.startswith(str(PACKAGE)) else None


def _stack(frame: FrameType | None) -> list[str]:
    """The package files on ``frame``'s stack, outermost first, collapsed."""
    files: list[str] = []
    while frame is not None:
        file = _package_file(frame.f_code.co_filename)
        if file is not None:
            files.append(file)
        frame = frame.f_back
    return collapsed(reversed(files))


def collapsed(calls: Iterable[str]) -> list[str]:
    """``calls`` with each run of consecutive calls in one file written once."""
    walk: list[str] = []
    for file in calls:
        if not walk or walk[-1] != file:
            walk.append(file)
    return walk


def rank_of(file: str) -> int:
    """The layer of a package file (lower: higher up), from ``tests/test_layers.py``."""
    unit = STAND_INS.get(file) or unit_of(
        "trio_encode." + file.removesuffix(".py").replace("/", ".")
    )
    return RANK[unit]


def climbs(walk: list[str]) -> int:
    """The steps of ``walk`` that go to a file of a higher layer than the one before."""
    return sum(rank_of(after) < rank_of(before) for before, after in pairwise(walk))


@dataclass(frozen=True)
class Walk:
    route: str
    calls: list[tuple[str | None, str]]
    chains: dict[str, list[str]] = field(default_factory=dict)
    """The handler's own call stack at its first call into each of :data:`CHAIN_TARGETS`."""

    def files(self, leave_out: frozenset[str] = frozenset()) -> list[str]:
        """The walk: the called files in order, collapsed, without ``leave_out``."""
        return collapsed(file for _, file in self.calls if file not in leave_out)

    def calls_up(self, leave_out: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
        """Each call made from a file of the package into one of a higher layer (a callback,
        a closure handed down), as (caller, called)."""
        return [
            (caller, file)
            for caller, file in self.calls
            if caller is not None
            and caller not in leave_out
            and file not in leave_out
            and rank_of(file) < rank_of(caller)
        ]

    def lines(self, leave_out: frozenset[str] = frozenset()) -> list[str]:
        walk = self.files(leave_out)
        up = Counter(self.calls_up(leave_out))
        return [
            f"files crossed: {len(set(walk))}",
            f"climbs back up: {climbs(walk)}",
            f"steps: {len(walk)}",
            "walk: " + " -> ".join(walk),
            f"calls up (caller below the called): {sum(up.values())}",
            *(f"  {caller} -> {file}: {count}" for (caller, file), count in sorted(up.items())),
        ]


@asynccontextmanager
async def engines(kind: str) -> AsyncIterator[tuple[TransferEngine, TransferEngine]]:
    """The server's engine and one receiving rank's."""
    if kind == "mooncake":
        from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings

        settings = MooncakeSettings()
        yield await MooncakeEngine.create(settings), await MooncakeEngine.create(settings)
    else:
        from trio_encode.testing.memory_engine import InMemoryFabric

        fabric = InMemoryFabric()
        yield fabric.engine("127.0.0.1"), fabric.engine("127.0.0.1")


async def walk_routes(engine: str = "memory") -> list[Walk]:
    """One warm-up ``/encode`` and ``/send`` untraced, then one of each traced."""
    encoder = ImageEncoder.from_settings(replace(SMALL, max_batch_wait=0.0))
    tracer = Tracer()
    tracer.install()
    try:
        async with (
            engines(engine) as (server_engine, rank),
            open_server(
                ServerSettings.exactly(port=0), engine=server_engine, encoder=encoder
            ) as running,
            httpx.AsyncClient(base_url=running.url, timeout=60) as client,
        ):
            buffer = torch.zeros(1 << 20, dtype=torch.uint8)
            await rank.register(buffer.data_ptr(), buffer.numel())

            async def post(route: str, body: dict[str, Any]) -> None:
                answer = await client.post(route, json=body)
                assert answer.status_code == 200, (route, answer.text)

            def encode(req_id: str, seed: int) -> dict[str, Any]:
                return {"req_id": req_id, "mm_items": [noise_uri(seed)], "receive_count": 1}

            def send(req_id: str) -> dict[str, Any]:
                address = buffer.data_ptr()
                return {"req_id": req_id, "session_id": rank.session_id, "buffer_address": address}

            await post("/encode", encode("warm-up", 1))
            await post("/send", send("warm-up"))
            bodies = {"/encode": encode("walked", 2), "/send": send("walked")}  # made untraced
            walks = []
            for route, body in bodies.items():
                calls = await tracer.trace(partial(post, route, body))
                walks.append(Walk(route, calls, dict(tracer.chains)))
            await rank.deregister(buffer.data_ptr())
    finally:
        tracer.remove()
    return walks


def module_lines(package: Path = PACKAGE) -> list[tuple[str, int | None]]:
    """Lines of each of :data:`MODULES` (None: no such module)."""
    found: list[tuple[str, int | None]] = []
    for pattern in MODULES:
        paths = sorted(package.glob(pattern))
        if not paths:
            found.append((pattern, None))
        for path in paths:
            found.append((path.relative_to(package).as_posix(), len(path.read_text().splitlines())))
    return found


def core_duplicates(package: Path = PACKAGE) -> str:
    """``duplicates --min-lines 4``'s first line for the core: the package but tools/ and
    testing/, copied aside so that no pair has a side there."""
    with tempfile.TemporaryDirectory() as folder:
        core = Path(folder) / "trio_encode"
        shutil.copytree(package, core, ignore=shutil.ignore_patterns("__pycache__"))
        for left_out in CORE_LEFT_OUT:
            shutil.rmtree(core / left_out, ignore_errors=True)
        done = subprocess.run(
            ["duplicates", "--repo", str(core), "--min-lines", "4", "--seconds", "60"],
            capture_output=True,
            text=True,
            check=True,
        )
    return done.stdout.splitlines()[0]


def report(walks: list[Walk], *, with_sizes: bool = True) -> list[str]:
    lines = [f"package: {PACKAGE}"]
    for walk in walks:
        lines.append(f"== {walk.route}")
        for target, chain in sorted(walk.chains.items()):
            lines.append(
                f"  stack at the first call into {target}: {len(set(chain))} files, "
                f"{climbs(chain)} climbs: " + " -> ".join(chain)
            )
        lines += ["  " + line for line in walk.lines()]
        lines.append("  without observers/logs/metrics:")
        lines += ["    " + line for line in walk.lines(OBSERVERS)]
    if with_sizes:
        lines.append("== lines per module")
        total = 0
        for name, count in module_lines():
            lines.append(f"  {name}: {'absent' if count is None else count}")
            total += count or 0
        lines.append(f"  total: {total}")
        lines.append("== duplicates --min-lines 4, core (no tools/, testing/)")
        lines.append("  " + core_duplicates())
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("memory", "mooncake"), default="memory")
    args = parser.parse_args()
    walks = trio.run(walk_routes, args.engine)
    print("\n".join(report(walks)))


if __name__ == "__main__":
    main()
