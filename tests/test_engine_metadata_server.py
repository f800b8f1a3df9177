"""The engine with Mooncake's HTTP metadata server instead of P2P handshakes.

Operators who run ``mooncake_http_metadata_server`` (it ships with Mooncake) name it with
``--engine-metadata-server http://HOST:PORT/metadata``: descriptors then come from it, and no
transfer waits on a handshake with a peer. Engines are named by their hostname there, so each
needs its own (loopback aliases here).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import trio

from trio_encode.engine import Write
from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings


@pytest.fixture
def metadata_url() -> Iterator[str]:
    """A running ``mooncake_http_metadata_server`` on a free loopback port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = Path(sys.executable).parent / "mooncake_http_metadata_server"
    command = [str(server), "--host", "127.0.0.1", "--port", str(port), "--log-level", "ERROR"]
    process = subprocess.Popen(command)
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                assert process.poll() is None, "the metadata server exited"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/metadata"
    finally:
        process.kill()
        process.wait()


async def test_a_transfer_through_an_http_metadata_server(metadata_url: str) -> None:
    sender = await MooncakeEngine.create(MooncakeSettings(metadata_server=metadata_url))
    receiver = await MooncakeEngine.create(
        MooncakeSettings(metadata_server=metadata_url, hostname="127.0.0.2")
    )
    assert receiver.session_id == "127.0.0.2"  # its name in the metadata server
    source = torch.arange(8192, dtype=torch.int32).view(torch.uint8)
    landing = torch.zeros_like(source)
    await sender.register(int(source.data_ptr()), source.numel())
    await receiver.register(int(landing.data_ptr()), landing.numel())
    with trio.fail_after(10):
        await sender.transfer(
            Write(
                receiver.session_id,
                [(int(source.data_ptr()), source.numel())],
                int(landing.data_ptr()),
            )
        )
    assert torch.equal(source, landing)
    await sender.deregister(int(source.data_ptr()))
    await receiver.deregister(int(landing.data_ptr()))
