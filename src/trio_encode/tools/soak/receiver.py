"""A prefill rank's landing memory in a process of its own, so it can be paused or killed.

What a frozen or dead rank does to the server depends on its *transfer engine*: a paused
process stops answering Mooncake (a transfer into it hangs until the engine's own timeout), a
killed one refuses connections (a transfer fails at once). So each receiver here is a real
process with its own Mooncake engine and one registered pool, and the HTTP calls a rank would
make are made by whoever drives it (a test, the soak), naming this process's ``session_id``
and an address in its pool.

The child is a plain loop over JSON lines on stdin (no event loop: nothing to interleave):

- ``{"op": "check", "offset", "part", "digests", "length"}``: do the ``len(digests)`` parts of
  ``part`` bytes from ``offset`` on have these xxh3-64 digests? Answers ``{"ok": [bool, ...]}``
  and then fills ``length`` bytes from ``offset`` with :data:`MARKER`, so a write that lands
  later shows;
- ``{"op": "verify", "offset", "length", "part", "expected"}``: read the range word by word
  (:func:`~trio_encode.testing.identity.read_slot`: the images ``expected`` in place, the
  rest blank), answer the reading, then fill it with :data:`MARKER`;
- ``{"op": "read", "offset", "length", "part", "known"}``: the reading of a range that should
  be blank (stamps of ``known`` identities are its own late bytes, others foreign);
- ``{"op": "fill", "offset", "length"}``: fill it with :data:`MARKER` (answers ``{}``).

Its first line out is ``{"session_id", "address", "nbytes"}``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from trio_encode.testing.identity import MARKER, SlotReading, read_slot
from trio_encode.tools.children import Lines

# -- the child ----------------------------------------------------------------------------------


def _child(pool_bytes: int, host: str) -> None:
    import numpy as np
    import xxhash

    from trio_encode.engine.mooncake import _load_mooncake_engine_class

    engine = _load_mooncake_engine_class("ERROR")()
    code = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if code != 0:
        raise SystemExit(f"mooncake initialize failed with {code}")
    pool = np.zeros(pool_bytes, dtype=np.uint8)
    address = int(pool.ctypes.data)
    code = engine.register_memory(address, pool_bytes)
    if code != 0:
        raise SystemExit(f"mooncake register_memory failed with {code}")
    out = sys.stdout
    hello = {
        "session_id": f"{host}:{engine.get_rpc_port()}",
        "address": address,
        "nbytes": pool_bytes,
    }
    out.write(json.dumps(hello) + "\n")
    out.flush()
    for line in sys.stdin:
        ask = json.loads(line)
        op = ask["op"]
        answer: dict[str, Any] = {}
        if op == "check":
            offset, part = ask["offset"], ask["part"]
            answer["ok"] = [
                xxhash.xxh3_64_intdigest(pool[start : start + part].data) == digest
                for start, digest in zip(
                    range(offset, offset + part * len(ask["digests"]), part),
                    ask["digests"],
                    strict=True,
                )
            ]
            pool[offset : offset + ask["length"]] = MARKER
        elif op in ("verify", "read"):
            offset, length = ask["offset"], ask["length"]
            reading = read_slot(
                pool[offset : offset + length],
                ask["part"],
                expected=ask.get("expected", ()),
                known=ask.get("known", ()),
            )
            answer = reading.to_json()
            if op == "verify":
                pool[offset : offset + length] = MARKER
        elif op == "fill":
            pool[ask["offset"] : ask["offset"] + ask["length"]] = MARKER
        else:
            raise SystemExit(f"unknown op {op!r}")
        out.write(json.dumps(answer) + "\n")
        out.flush()
    engine.unregister_memory(address)


# -- the parent's handle ------------------------------------------------------------------------


def _until_stopped(pid: int, within: float = 5.0) -> None:
    """Block until every thread of ``pid`` is stopped. SIGSTOP is only queued by ``kill``:
    on a loaded machine the process may still answer for a while (a first-contact probe,
    then stop before the handshake that follows it), and a test would race its own freeze."""
    deadline = time.monotonic() + within
    tasks = f"/proc/{pid}/task"
    while time.monotonic() < deadline:
        try:
            states = [_thread_state(f"{tasks}/{tid}/stat") for tid in os.listdir(tasks)]
        except FileNotFoundError:
            return  # it exited: nothing answers either
        if all(state in "tTXZ" for state in states):
            return
        time.sleep(0.001)
    raise RuntimeError(f"process {pid} did not stop within {within:g} s of SIGSTOP")


def _thread_state(stat_path: str) -> str:
    """The state letter of ``/proc/<pid>/task/<tid>/stat`` ('X' once the thread is gone)."""
    try:
        with open(stat_path) as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "X"


class ReceiverGone(Exception):
    """The receiver process exited (killed, or it failed) before it answered."""


class ReceiverProcess:
    """The driver's side of one receiver process."""

    def __init__(self, process: trio.Process, name: str) -> None:
        self.process = process
        self.name = name
        self.session_id = ""
        """The ``session_id`` of its engine, to name in ``/send``."""
        self.address = 0
        """Where its registered pool starts, in its own address space."""
        self.nbytes = 0
        self.frozen = False
        self._thawed = trio.Event()
        self._thawed.set()
        self._lock = trio.Lock()
        assert process.stdout is not None
        self._lines = Lines(process.stdout)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def ask(self, **request: Any) -> dict[str, Any]:
        """Send one command and wait for its answer (one at a time)."""
        async with self._lock:
            assert self.process.stdin is not None
            try:
                await self.process.stdin.send_all(json.dumps(request).encode() + b"\n")
                answer: dict[str, Any] = json.loads(await self._read_line())
            except (trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
                raise ReceiverGone(f"receiver {self.name} is gone") from None
            return answer

    async def _hello(self) -> None:
        hello = json.loads(await self._read_line())
        self.session_id, self.address, self.nbytes = (
            hello["session_id"],
            int(hello["address"]),
            int(hello["nbytes"]),
        )

    async def _read_line(self) -> bytes:
        line = await self._lines.next()
        if line is None:
            raise EOFError
        return line

    async def check(self, offset: int, part: int, digests: list[int], length: int) -> list[bool]:
        """Whether each part landed with its digest; ``length`` bytes from ``offset`` are then
        filled with MARKER."""
        answer = await self.ask(
            op="check", offset=offset, part=part, digests=digests, length=length
        )
        return [bool(ok) for ok in answer["ok"]]

    async def verify(self, offset: int, length: int, part: int, expected: list[int]) -> SlotReading:
        """What the range holds, the stamped images ``expected`` in place and the rest blank;
        it is then filled with MARKER."""
        answer = await self.ask(
            op="verify", offset=offset, length=length, part=part, expected=expected
        )
        return SlotReading.from_json(answer)

    async def read(self, offset: int, length: int, part: int, known: list[int]) -> SlotReading:
        """What a range that should be blank holds (since it was checked or filled)."""
        answer = await self.ask(op="read", offset=offset, length=length, part=part, known=known)
        return SlotReading.from_json(answer)

    async def fill(self, offset: int, length: int) -> None:
        await self.ask(op="fill", offset=offset, length=length)

    def freeze(self) -> None:
        """SIGSTOP: its engine stops answering, as a wedged host's would."""
        self.frozen = True
        self._thawed = trio.Event()
        self.process.send_signal(signal.SIGSTOP)
        _until_stopped(self.process.pid)

    def thaw(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.frozen = False
        self._thawed.set()

    async def wait_thawed(self) -> None:
        """Return at once unless frozen; then when thawed (or killed)."""
        await self._thawed.wait()

    def kill(self) -> None:
        """SIGKILL: its engine's port closes, as a crashed rank's would."""
        self.process.kill()
        self.frozen = False
        self._thawed.set()


@asynccontextmanager
async def open_receiver(
    pool_bytes: int, name: str = "rank", host: str = "127.0.0.1"
) -> AsyncIterator[ReceiverProcess]:
    """Start a receiver process with a registered pool of ``pool_bytes``; killed on exit.
    ``host`` names its engine (another loopback address plays another node)."""
    env = {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_encode.tools.soak.receiver", str(pool_bytes), host],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        receiver = ReceiverProcess(process, name)
        with trio.fail_after(60):
            try:
                await receiver._hello()
            except EOFError:
                await process.wait()
                raise RuntimeError(
                    f"receiver {name} exited with {process.returncode} before it was ready"
                ) from None
        yield receiver
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            await process.wait()
            assert process.stdin is not None
            assert process.stdout is not None
            await process.stdin.aclose()
            await process.stdout.aclose()


if __name__ == "__main__":
    _child(int(sys.argv[1]), sys.argv[2])
