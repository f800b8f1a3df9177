"""The processes of the HTTP rows (and of the /send rows against another build), and their client.

Run as a file (``python servers.py KIND``), never as a module: with ``PYTHONPATH`` pointing at
another source tree, or under another interpreter, the same script then serves *that* build's
``trio_encode``, which may predate the bench's own modules. So it imports nothing from
``trio_encode.tools``, only what every build since the seed has (``open_server``,
``ServerSettings.exactly``, the stand-in encoder, the in-memory engine, ``ImageEncoder``).

Kinds (each prints ``{"port": N}`` once it listens on 127.0.0.1, and serves until its stdin
closes):

- ``floor``: hypercorn's Trio worker with a one-line ASGI app (reads the body, answers a fixed
  JSON object): what our fixed stack costs before any of our code runs;
- ``sglang``: a FastAPI/uvicorn handler the way SGLang's encode server writes one (the body
  through ``await request.json()``, a dict look-up, a dict answered);
- ``ours``: the encode server with the stand-in encoder and an in-memory engine (only HTTP and
  the service run), ``access_log`` on and logs to stderr as ``serve`` has them. The part
  ``bench`` is encoded and sent to one receiver of two before it says its port, so a pull,
  a repeated ``/send`` and a sibling's ``/encode`` are each answered from a live request;
- ``send NBYTES``: the encode server with a real Mooncake engine (TCP) and an output of
  NBYTES per image, for the ``/send`` rows against another build.

``client``: reads one JSON command a line (``{"port", "route", "seconds", "connections"}``),
calls the route over that many raw keep-alive connections for that long, and answers
``{"calls", "errors", "seconds", "reconnects", "failures"}``. It is a raw HTTP/1.1 client
(pre-built request bytes, ``Content-Length`` answers only) so that the client costs as little as
it can; it reconnects where an answer says ``Connection: close`` (hypercorn closes a connection
after 1,000 requests, uvicorn never), and that cost counts as the server's.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import threading
import time
from functools import partial
from typing import Any, cast

if (
    __name__ == "__main__"
    and sys.path
    and sys.path[0] == os.path.dirname(os.path.abspath(__file__))
):
    del sys.path[0]  # this folder's modules must not shadow the standard library's

PART = "bench"
"""The req_id the ``ours`` server holds live for the pulls, sends and sibling encodes."""
RECEIVE_COUNT = 2
"""Receivers ``PART`` waits for; one is served at start, so the request stays live."""
IMAGE = "data:image/png;base64,iVBORw0KGgo="
"""The item of ``PART`` (the stand-in encoder reads any base64 bytes)."""


def route_request(route: str, *, session_id: str = "", buffer_address: int = 0) -> bytes:
    """The bytes of one call of ``route`` (``pull``, ``send``, ``health``, ``encode``)."""
    bodies: dict[str, tuple[str, dict[str, Any] | None]] = {
        "health": ("/health", None),
        "pull": ("/scheduler_receive_meta_data", {"req_id": PART, "part_idx": 0}),
        "send": (
            "/send",
            {"req_id": PART, "session_id": session_id, "buffer_address": buffer_address},
        ),
        "encode": (
            "/encode",
            {"req_id": PART, "mm_items": [IMAGE], "receive_count": RECEIVE_COUNT},
        ),
    }
    path, body = bodies[route]
    if body is None:
        return f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode()
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


class RawConnection:
    """One keep-alive connection that sends pre-built requests and reads whole answers."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = self._connect()
        self.buffer = b""
        self.reconnects = 0
        """Connections the server closed (hypercorn closes one after 1,000 requests)."""

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def call(self, request: bytes) -> tuple[int, bytes]:
        """Status and body of the answer to ``request``; a new connection after an answer
        that said ``Connection: close``."""
        self.sock.sendall(request)
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            self._more()
        head, self.buffer = self.buffer[:end].decode("latin-1"), self.buffer[end + 4 :]
        lines = head.split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length, closing = None, False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection":
                closing = value.strip().lower() == "close"
        if length is None:
            raise RuntimeError(f"an answer without Content-Length: {head!r}")
        while len(self.buffer) < length:
            self._more()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        if closing:
            self.sock.close()
            self.sock, self.buffer = self._connect(), b""
            self.reconnects += 1
        return status, body

    def _more(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buffer += data

    def close(self) -> None:
        self.sock.close()


def _calls(command: dict[str, Any]) -> dict[str, Any]:
    """Run one command of the client: calls over raw connections for ``seconds``."""
    request = route_request(
        command["route"],
        session_id=command.get("session_id", ""),
        buffer_address=command.get("buffer_address", 0),
    )
    connections = [RawConnection(command["port"]) for _ in range(command["connections"])]
    counts = [0] * len(connections)
    errors = [0] * len(connections)
    start = threading.Barrier(len(connections) + 1)
    deadline = [0.0]

    failures: list[str] = []

    def loop(index: int) -> None:
        connection = connections[index]
        start.wait()
        try:
            while time.perf_counter() < deadline[0]:
                status, _ = connection.call(request)
                counts[index] += 1
                errors[index] += status != 200
        except Exception as exc:  # the parent fails the run, naming it
            failures.append(repr(exc))

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(connections))]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    deadline[0] = began + command["seconds"]
    start.wait()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - began
    for connection in connections:
        connection.close()
    reconnects = sum(c.reconnects for c in connections)
    answer = {"calls": sum(counts), "errors": sum(errors), "seconds": seconds}
    return answer | {"reconnects": reconnects, "failures": failures}


def _client() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_calls(json.loads(line))), flush=True)


def _floor() -> None:
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    answer = b'{"status":"ok"}'
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                event = (await receive())["type"]  # lifespan.startup, then lifespan.shutdown
                await send({"type": event + ".complete"})
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.keep_alive_timeout = 600

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(partial(serve, cast(Any, app), config))
            _say_port(int(urls[0].rsplit(":", 1)[1]))
            await _stdin_closed()
            os._exit(0)

    trio.run(main)


def _sglang() -> None:
    import asyncio

    import uvicorn
    from fastapi import FastAPI, HTTPException, Request

    # FastAPI reads each handler's (string) annotations in this module's namespace.
    globals()["Request"] = Request
    app = FastAPI()
    shape = {"embedding_len": 64, "embedding_dim": 512, "embedding_size": 131072}
    parts = {PART: {"req_id": PART, "part_idx": 0, **shape}}

    def known(body: dict[str, Any]) -> dict[str, Any]:
        part = parts.get(str(body["req_id"]))
        if part is None:
            raise HTTPException(404, "unknown req_id")
        return part

    @app.post("/scheduler_receive_meta_data")
    async def pull(request: Request) -> dict[str, Any]:
        return known(await request.json())

    @app.post("/send")
    async def send(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"status": "ok", **known(body), "session_id": body["session_id"]}

    @app.post("/encode")
    async def encode(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {**known(body), "receive_count": body.get("receive_count")}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    listener = socket.socket()
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=600)
    )
    _say_port(listener.getsockname()[1])
    threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
    asyncio.run(server.serve(sockets=[listener]))


def _ours() -> None:
    import trio

    from trio_encode.logs import setup_logging
    from trio_encode.server.metrics import Metrics
    from trio_encode.server.serve import open_server
    from trio_encode.settings import ServerSettings
    from trio_encode.testing.memory_engine import InMemoryFabric
    from trio_encode.testing.stand_in_encoder import StandInEncoder, embedding_size

    setup_logging("INFO")
    fabric = InMemoryFabric()
    engine = fabric.engine("127.0.0.1")
    receiver = fabric.engine("127.0.0.1")
    landing = bytearray(embedding_size(1))
    import ctypes

    address = ctypes.addressof((ctypes.c_char * len(landing)).from_buffer(landing))

    async def main() -> None:
        await receiver.register(address, len(landing))
        settings = ServerSettings.exactly(port=0, shutdown_grace=0.0)
        async with open_server(
            settings, engine=engine, encoder=StandInEncoder(), metrics=Metrics()
        ) as running:
            port = int(running.url.rsplit(":", 1)[1])
            target = {"session_id": receiver.session_id, "buffer_address": address}
            await trio.to_thread.run_sync(_prepare_part, port, target)
            _say_port(port, **target)
            await _stdin_closed()
            running.stop()

    trio.run(main)
    os._exit(0)


def _prepare_part(port: int, target: dict[str, Any]) -> None:
    """Encode ``PART`` and serve one of its two receivers, so it stays live."""
    connection = RawConnection(port)
    for route in ("encode", "send"):
        status, body = connection.call(route_request(route, **target))
        if status != 200:
            raise RuntimeError(f"setting up the part: {route} answered {status}: {body!r}")
    connection.close()


def _send(nbytes: int, arena: bool) -> None:
    import trio

    from trio_encode.arena import Arena
    from trio_encode.encoder import EncoderSettings, ImageEncoder
    from trio_encode.engine.mooncake import MooncakeEngine
    from trio_encode.server.metrics import Metrics
    from trio_encode.server.serve import open_server
    from trio_encode.settings import ServerSettings

    try:
        synthetic = importlib.import_module("trio_encode.tools.bench.synthetic")
    except ImportError:  # a baseline build from before the tools/ folder: its own layout
        synthetic = importlib.import_module("trio_encode.bench.synthetic")
    SizedBackend, tokens_for = synthetic.SizedBackend, synthetic.tokens_for

    window = 32
    settings = EncoderSettings(
        image_size=16,
        patch_size=16,
        max_batch_size=16,
        queue_size=max(64, 2 * window),
        cache_bytes=0,
        warmup=False,
    )
    pool = Arena((window + 2) * nbytes + (1 << 20), cache_bytes=0) if arena else None
    encoder = ImageEncoder(SizedBackend(tokens_for(nbytes)), settings, arena=pool)
    server_settings = ServerSettings.exactly(
        port=0, encoder=settings, shutdown_grace=0.0, access_log=False
    )

    async def main() -> None:
        engine = await MooncakeEngine.create()
        async with open_server(
            server_settings, engine=engine, encoder=encoder, metrics=Metrics()
        ) as running:
            _say_port(int(running.url.rsplit(":", 1)[1]))
            await _stdin_closed()
            running.stop()

    trio.run(main)
    os._exit(0)


def _say_port(port: int, **more: Any) -> None:
    print(json.dumps({"port": port, **more}), flush=True)


async def _stdin_closed() -> None:
    import trio

    await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


def _exit_when_stdin_closes() -> None:
    sys.stdin.read()
    os._exit(0)


def main(argv: list[str]) -> None:
    kind = argv[0]
    if kind == "client":
        _client()
    elif kind == "floor":
        _floor()
    elif kind == "sglang":
        _sglang()
    elif kind == "ours":
        _ours()
    elif kind == "send":
        _send(int(argv[1]), argv[2] == "arena")
    else:
        sys.exit(f"unknown kind {kind!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
