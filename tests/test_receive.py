"""``trio-encode receive``: a Mooncake receiver run from a shell, as an operator runs it: what it
prints is enough to make a server ``/send`` into it, and what lands is reported with the
length and checksum of the ``/encode`` answer."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import numpy as np

from support.cli_process import operator_env, read_until_serving, serving, wait_ready
from trio_encode.embedding import checksum_of
from trio_encode.testing.images import noise_uri
from trio_encode.tools.receive import FILL, Buffer, send_lines


@contextmanager
def receiving(*args: str) -> Iterator[subprocess.Popen[str]]:
    """``trio-encode receive ARGS`` with stdout piped; killed if the test leaves it running."""
    process = subprocess.Popen(
        [sys.executable, "-m", "trio_encode", "receive", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=operator_env(),
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def read_until(process: subprocess.Popen[str], pattern: str, lines: list[str]) -> re.Match[str]:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matched {pattern!r}:\n" + "".join(lines))


def test_what_receive_prints_is_enough_to_send_to_it_and_each_landing_is_checked() -> None:
    with serving("--port", "0", "--shutdown-grace", "1") as server:
        url = read_until_serving(server, [])
        wait_ready(url)
        with receiving("--server", url, "--buffer-bytes", "8MiB") as receiver:
            out: list[str] = []
            session = read_until(receiver, r"session_id:\s+(\S+)", out)[1]
            address = int(read_until(receiver, r"buffer_address:\s+(\d+)", out)[1])
            assert int(read_until(receiver, r"buffer_length:\s+(\d+)", out)[1]) == 8 << 20
            pasted = read_until(receiver, r"curl .* (\S+)/send -d '(.*)'$", out)
            assert pasted[1] == url
            assert json.loads(pasted[2]) == {
                "req_id": "try-1",
                "session_id": session,
                "buffer_address": address,
            }
            read_until(receiver, "waiting for landings", out)
            for n, seed in enumerate((1, 2), start=1):  # the buffer is filled again for the next
                req = {"req_id": f"r{n}", "mm_items": [noise_uri(seed, 64 * n)], "receive_count": 1}
                encoded = httpx.post(url + "/encode", json=req, timeout=60).json()
                send = {"req_id": f"r{n}", "session_id": session, "buffer_address": address}
                sent = httpx.post(url + "/send", json=send, timeout=60)
                assert sent.status_code == 200, sent.text
                landed = read_until(receiver, r"landed #(\d+): (\d+) bytes, checksum (\S+)", out)
                assert landed.groups() == (
                    str(n),
                    str(encoded["embedding_size"]),
                    encoded["checksum"],
                )
            receiver.send_signal(signal.SIGINT)
            rest, _ = receiver.communicate(timeout=30)
            assert receiver.returncode == 0, rest
            assert "stopped: 2 landings; the buffer is deregistered" in rest


def test_a_landing_is_the_run_up_to_the_last_byte_no_longer_fill() -> None:
    """Every length, odd ones too; a whole fill word inside the run is a transfer still under
    way, not a landing."""
    buffer = Buffer(64)
    assert buffer.landed() is None
    assert not buffer.touched()
    data = np.arange(1, 38, dtype=np.uint8)  # 37 bytes: the last word part-written
    buffer.bytes[:37] = data
    landing = buffer.landed()
    assert landing is not None
    assert buffer.touched()
    assert (landing.nbytes, landing.checksum) == (37, checksum_of(data.tobytes()))
    buffer.bytes[8:16] = FILL  # a hole: the middle has not landed yet
    assert buffer.landed() is None
    buffer.refill(64)
    assert buffer.landed() is None
    assert bytes(buffer.bytes) == b"\xff" * 64


def test_the_pasted_lines_name_the_server_the_session_and_the_address() -> None:
    encode, send = send_lines("http://h:1/", "10.0.0.2:17000", 4096, "data:image/png;base64,AA")
    assert encode.endswith(
        "http://h:1/encode -d '"
        '{"req_id": "try-1", "mm_items": ["data:image/png;base64,AA"], "receive_count": 1}\''
    )
    assert send.endswith(
        "http://h:1/send -d '"
        '{"req_id": "try-1", "session_id": "10.0.0.2:17000", "buffer_address": 4096}\''
    )
