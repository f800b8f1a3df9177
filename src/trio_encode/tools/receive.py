"""``trio-encode receive``: a Mooncake receiver run from a shell, to try ``/send`` by hand.

It starts its own transfer engine, registers one buffer, prints what a ``/send`` must name
(the engine's ``session_id``, the buffer's address and length) with ready-to-paste ``curl``
lines for ``/encode`` and ``/send``, then prints each landing: its length and the checksum of
its bytes, in the form of the ``checksum`` of the ``/encode`` and ``/send`` answers, so the two
can be compared by eye (or by a script). Ctrl-C (or SIGTERM) ends it, deregistering first.

A transfer does not tell its receiver that it landed, so the buffer is watched: it is filled
with ``0xFF`` bytes, which no embedding ends with (the last byte of a little-endian float16,
bfloat16 or float32 holds its sign and top exponent bits, all ones only for a NaN or an
infinity), and a landing is the run of bytes from the buffer's start up to the last one that
is no longer ``0xFF``, once it has stopped changing. The buffer is filled again after each
landing; send one request at a time, at the printed address.

Only the settings are imported with this module (``receive --help`` reads them); the engine,
numpy and the checksum load when it runs.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from pydantic.dataclasses import dataclass as settings_dataclass

from trio_encode.declare import SETTINGS, in_group
from trio_encode.sizes import ByteSize, MiB, format_size

if TYPE_CHECKING:
    import numpy as np

    from trio_encode.engine.mooncake import MooncakeSettings

receive_setting = in_group("receive")

FILL = 0xFF
"""The byte the buffer holds where nothing has landed (see the module's docstring)."""
SETTLE_SECONDS = 0.1
"""A landing is reported once two looks this far apart see the same bytes."""


@settings_dataclass(frozen=True, config=SETTINGS)
class ReceiveSettings:
    """The receiver's own knobs (its engine is set by the --engine-* flags)."""

    buffer_bytes: ByteSize = receive_setting(64 * MiB, gt=0)
    """Size of the registered buffer /send writes into: at least the embedding_size of what will
    be sent."""
    server: str = receive_setting("http://127.0.0.1:8000")
    """URL of the encode server the printed curl lines call."""
    landings: int | None = receive_setting(None, gt=0)
    """Exit after this many landings (default: run until Ctrl-C)."""
    poll_interval: float = receive_setting(0.02, gt=0)
    """Seconds between looks at the buffer's first bytes."""


@dataclass(frozen=True)
class Landing:
    """Bytes that landed at the buffer's start."""

    nbytes: int
    checksum: str


class Buffer:
    """The registered memory, filled with :data:`FILL`; what landed in it."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        words = -(-nbytes // 8)
        self._words: np.ndarray[Any, np.dtype[np.uint64]] = np.full(
            words, np.uint64(0xFFFF_FFFF_FFFF_FFFF), dtype=np.uint64
        )
        self.bytes: np.ndarray[Any, np.dtype[np.uint8]] = self._words.view(np.uint8)[:nbytes]
        self.nbytes = nbytes

    @property
    def address(self) -> int:
        return int(self._words.ctypes.data)

    def touched(self) -> bool:
        """Whether anything landed at the start (a cheap look: its first 8 bytes)."""
        return bool(self._words[0] != self._words.dtype.type(0xFFFF_FFFF_FFFF_FFFF))

    def landed(self) -> Landing | None:
        """The bytes from the start up to the last one that is not :data:`FILL`; None while
        none has landed, or while a whole word inside that run is still fill (a transfer
        still under way: no embedding holds eight ``0xFF`` bytes in a row)."""
        import numpy as np

        from trio_encode.embedding import checksum_of

        full = self._words.dtype.type(0xFFFF_FFFF_FFFF_FFFF)
        written = np.flatnonzero(self._words != full)
        if not len(written):
            return None
        last_word = int(written[-1])
        if len(written) != last_word + 1:
            return None
        tail = self._words[last_word : last_word + 1].view(np.uint8)
        last_byte = int(np.flatnonzero(tail != FILL)[-1])
        nbytes = min(self.nbytes, last_word * 8 + last_byte + 1)
        return Landing(nbytes, checksum_of(self.bytes[:nbytes].data))

    def refill(self, nbytes: int) -> None:
        """Make the first ``nbytes`` fill again, ready for the next landing."""
        self.bytes[:nbytes] = FILL


def send_lines(server: str, session_id: str, address: int, example_image: str) -> list[str]:
    """What to paste to make something land here: an ``/encode`` and its ``/send``."""
    encode = {"req_id": "try-1", "mm_items": [example_image], "receive_count": 1}
    send = {"req_id": "try-1", "session_id": session_id, "buffer_address": address}
    curl = "curl -sS -H 'Content-Type: application/json'"
    return [
        f"{curl} {server.rstrip('/')}/encode -d '{json.dumps(encode)}'",
        f"{curl} {server.rstrip('/')}/send -d '{json.dumps(send)}'",
    ]


async def run_receive(
    engine_settings: MooncakeSettings,
    config: ReceiveSettings,
    out: Callable[[str], None] | None = None,
) -> int:
    """Receive until Ctrl-C/SIGTERM or ``config.landings``; returns how many landed. Every
    line goes to ``out`` (stdout, flushed, by default)."""
    from trio_encode.engine.mooncake import MooncakeEngine
    from trio_encode.engine.rdma_devices import check_rdma
    from trio_encode.testing.images import image_uri, solid_image

    say = out if out is not None else _print
    check_rdma(engine_settings.protocol, engine_settings.device)
    engine = await MooncakeEngine.create(engine_settings)
    buffer = Buffer(config.buffer_bytes)
    await engine.register(buffer.address, buffer.nbytes)
    count = 0
    try:
        say(
            f"receiver ready: a {format_size(buffer.nbytes)} buffer registered with a Mooncake "
            f"engine over {engine_settings.protocol}; a /send names:"
        )
        say(f"  session_id:     {engine.session_id}")
        say(f"  buffer_address: {buffer.address}")
        say(f"  buffer_length:  {buffer.nbytes}")
        say(f"try it (against {config.server}; add -H 'Authorization: Bearer TOKEN' with auth):")
        for line in send_lines(
            config.server, engine.session_id, buffer.address, image_uri(solid_image(8, 8))
        ):
            say(f"  {line}")
        say("waiting for landings (one /send at a time, at buffer_address; Ctrl-C stops)")
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_signal, signals, nursery.cancel_scope)
                while config.landings is None or count < config.landings:
                    landing = await _next_landing(buffer, config.poll_interval)
                    count += 1
                    say(
                        f"landed #{count}: {landing.nbytes} bytes, checksum {landing.checksum} "
                        "(compare: the checksum and embedding_size of the /encode answer)"
                    )
                    buffer.refill(landing.nbytes)
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await engine.deregister(buffer.address)
    say(f"stopped: {count} landing{'' if count == 1 else 's'}; the buffer is deregistered")
    return count


async def _next_landing(buffer: Buffer, poll_interval: float) -> Landing:
    """The next landing, once its bytes have stopped changing."""
    while True:
        while not buffer.touched():  # noqa: ASYNC110 (a landing signals nothing: look)
            await trio.sleep(poll_interval)
        seen = buffer.landed()
        while True:
            await trio.sleep(SETTLE_SECONDS)
            now = buffer.landed()
            if now is not None and now == seen:
                return now
            seen = now


async def _cancel_on_signal(signals: Any, scope: trio.CancelScope) -> None:
    async for _ in signals:
        scope.cancel()
        return


def _print(line: str) -> None:
    print(line, flush=True)
