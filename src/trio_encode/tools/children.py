"""The tools' child processes (servers, receivers, the bench's peer): reading their output a
line at a time, and stopping them."""

from __future__ import annotations

import signal

import trio


class Lines:
    """Whole lines from a child's pipe, which hands out chunks cut anywhere."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def next(self) -> bytes | None:
        """The next line without its ``\\n``; None once the pipe has closed."""
        while b"\n" not in self._buffer:
            chunk = await self._stream.receive_some(1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line


async def stop(process: trio.Process, *, grace: float) -> None:
    """SIGTERM, and SIGKILL if ``process`` has not exited ``grace`` seconds later; shielded, so
    it also runs to the end on the way out of a cancelled scope."""
    with trio.CancelScope(shield=True):
        if process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace):
            await process.wait()
            return
        process.kill()
        await process.wait()
