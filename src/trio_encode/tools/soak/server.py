"""``trio-encode serve`` as a child process: the server a deployment runs, seen from outside.

Started with ``--port 0``; its bound address is read from its log (``serving on URL``). Its log
is kept (the last lines, and every ERROR line), its resident memory read from ``/proc``, and
it can be sent signals. On exit it gets SIGTERM, and SIGKILL if it has not stopped in time.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import httpx
import trio

from trio_encode.settings import child_environment
from trio_encode.tools.children import Lines, stop

_SERVING = re.compile(r"serving on (http://[^\s]+)")


class ServerProcess:
    """A running ``trio-encode serve``; create with :func:`open_server_process`."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.url = ""
        self.tail: deque[str] = deque(maxlen=20_000)
        """The last lines of its log: enough to hold a drill's whole run, so a line logged
        once (a signal received) is still there after a burst of per-request lines."""
        self.errors: list[str] = []
        """Every log line at ERROR level or above, and any traceback line."""
        assert process.stderr is not None
        self._lines = Lines(process.stderr)

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss(self) -> int:
        """Resident set size in bytes now (0 once it has exited)."""
        try:
            with open(f"/proc/{self.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError):
            pass
        return 0

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def wait(self) -> int:
        return await self.process.wait()

    def log(self) -> str:
        return "".join(self.tail)

    async def _read_line(self) -> str | None:
        raw = await self._lines.next()
        if raw is None:
            return None
        line = raw.decode(errors="replace") + "\n"
        self.tail.append(line)
        if "level=ERROR" in line or "level=CRITICAL" in line or "Traceback" in line:
            self.errors.append(line)
        return line

    async def _drain(self) -> None:
        while await self._read_line() is not None:
            pass


@asynccontextmanager
async def open_server_process(
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    start_timeout: float = 120.0,
    stop_timeout: float = 60.0,
    command: str = "serve",
) -> AsyncIterator[ServerProcess]:
    """Run ``trio-encode COMMAND --port 0 ARGS`` (``serve``, or ``drill-serve`` for a drill's
    faults) with ``env`` added to this process's environment, less its ``TRIO_ENCODE_*``
    variables (``ARGS`` are all its settings).

    Yields once it is ready (``/readyz`` answers 200); on exit stops it (SIGTERM, then SIGKILL after
    ``stop_timeout``) and keeps reading its log until it has gone.
    """
    argv = [sys.executable, "-m", "trio_encode.cli", command, "--port", "0", *args]
    full_env = {"MC_LOG_LEVEL": "ERROR", **child_environment(env)}
    process = await trio.lowlevel.open_process(argv, stderr=subprocess.PIPE, env=full_env)
    server = ServerProcess(process)
    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(start_timeout):
                while not server.url:
                    line = await server._read_line()
                    if line is None:
                        await process.wait()
                        raise RuntimeError(
                            f"trio-encode serve exited with {process.returncode} before "
                            f"serving:\n{server.log()}"
                        )
                    match = _SERVING.search(line)
                    if match:
                        server.url = match[1]
                # The port opens before the model has loaded: ready is what /readyz says.
                nursery.start_soon(server._drain)
                async with httpx.AsyncClient(base_url=server.url) as http:
                    while (await http.get("/readyz")).status_code != 200:  # noqa: ASYNC110
                        await trio.sleep(0.05)
            try:
                yield server
            finally:
                await stop(process, grace=stop_timeout)
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
            assert process.stderr is not None
            await process.stderr.aclose()
