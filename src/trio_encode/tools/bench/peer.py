"""The peer row: an asyncio encode server that sends the way SGLang's does after its race fix.

This is our own small model of how SGLang's encode server sends after its race fix, written
here to be timed against the same load, not SGLang's code: FastAPI on uvicorn (SGLang's
stack), one registration per ``req_id`` made by the first ``/send`` and shared by its
siblings, ``transfer_sync_write`` in a worker thread (``asyncio.to_thread``), an error for a
negative return code, and deregistration after the last of ``receive_count`` receivers. Its
``/encode`` does not run a model: it fills an embedding of the requested size (only ``/send``
is timed). It runs in a process of its own (``python -m trio_encode.tools.bench.peer``) and prints
``{"port": N}`` once it listens on 127.0.0.1.

Needs the ``bench`` extra (``pip install 'trio-encode[bench]'``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from trio_encode.embedding import checksum_of
from trio_encode.tools.children import Lines, stop

INSTALL_HINT = "the peer row needs FastAPI and uvicorn: pip install 'trio-encode[bench]'"


@dataclass(eq=False)
class _PeerRequest:
    buffer: bytearray
    receive_count: int
    checksum: str
    registered: bool = False
    sent: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def create_peer_app(engine: Any) -> Any:
    """The FastAPI app over a raw ``mooncake.engine.TransferEngine``."""
    import ctypes

    from fastapi import FastAPI, HTTPException

    app = FastAPI()
    requests: dict[str, _PeerRequest] = {}

    def address(buffer: bytearray) -> int:
        return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))

    @app.post("/encode")
    async def encode(body: dict[str, Any]) -> dict[str, Any]:
        nbytes, req_id = int(body["nbytes"]), str(body["req_id"])
        seed = int(body.get("seed", 0)) % 251 + 1
        buffer = bytearray(bytes(range(seed, 256)) * (nbytes // (256 - seed) + 1))[:nbytes]
        checksum = await asyncio.to_thread(checksum_of, bytes(buffer))
        requests[req_id] = _PeerRequest(buffer, int(body.get("receive_count", 1)), checksum)
        return {"req_id": req_id, "embedding_size": nbytes, "checksum": checksum}

    @app.post("/send")
    async def send(body: dict[str, Any]) -> dict[str, Any]:
        req_id = str(body["req_id"])
        request = requests.get(req_id)
        if request is None:
            raise HTTPException(404, f"unknown req_id {req_id}")
        local, nbytes = address(request.buffer), len(request.buffer)
        async with request.lock:  # the first send registers; siblings reuse it
            if not request.registered:
                code = await asyncio.to_thread(engine.register_memory, local, nbytes)
                if code != 0:
                    raise HTTPException(502, f"register failed with code {code}")
                request.registered = True
        code = await asyncio.to_thread(
            engine.transfer_sync_write,
            str(body["session_id"]),
            local,
            int(body["buffer_address"]),
            nbytes,
        )
        if code < 0:
            raise HTTPException(502, f"transfer failed with code {code}")
        request.sent += 1
        if request.sent >= request.receive_count:
            engine.unregister_memory(local)
            del requests[req_id]
        return {"req_id": req_id, "embedding_size": nbytes, "checksum": request.checksum}

    return app


def _main() -> None:
    try:
        import uvicorn
    except ImportError:
        sys.exit(INSTALL_HINT)
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        sys.exit("the peer's Mooncake engine did not initialise")
    listener = socket.socket()
    # Accepted connections inherit it: answers leave at once, not after a delayed ACK.
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    # A long keep-alive: the bench's clients reuse connections across phases, and a server
    # closing an idle one just as a client reuses it fails that request.
    config = uvicorn.Config(
        create_peer_app(engine), log_level="warning", access_log=False, timeout_keep_alive=600
    )
    server = uvicorn.Server(config)
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    asyncio.run(server.serve(sockets=[listener]))


@asynccontextmanager
async def open_peer() -> AsyncIterator[str]:
    """Start the peer process; its base URL while the body runs, then stop it."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_encode.tools.bench.peer"], stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    try:
        with trio.fail_after(60):
            line = await Lines(process.stdout).next()
            if line is None:
                await process.wait()
                raise RuntimeError(
                    f"the peer process exited with {process.returncode} ({INSTALL_HINT}?)"
                )
        yield f"http://127.0.0.1:{json.loads(line)['port']}"
    finally:
        with trio.CancelScope(shield=True):
            await stop(process, grace=10)
            await process.stdout.aclose()


if __name__ == "__main__":
    _main()
