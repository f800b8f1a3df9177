"""A minimal HTTP/1.1 server on loopback with canned answers, for the tests that fetch
``http://`` items."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import trio


@dataclass
class WebServer:
    """A minimal HTTP/1.1 server: each path answers with a canned status, headers and body."""

    routes: dict[str, tuple[int, dict[str, str], bytes]] = field(default_factory=dict)
    hang: set[str] = field(default_factory=set)
    port: int = 0
    requests: list[tuple[str, str]] = field(default_factory=list)  # (path, Host header)
    heads: list[bytes] = field(default_factory=list)
    """Each request's head (request line and headers), as sent."""

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    async def handle(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            data += chunk
        lines = data.split(b"\r\n")
        path = lines[0].split()[1].decode()
        host = next(
            (line[5:].strip().decode() for line in lines if line.lower().startswith(b"host:")), ""
        )
        self.requests.append((path, host))
        self.heads.append(data.partition(b"\r\n\r\n")[0])
        if path in self.hang:
            await trio.sleep_forever()
        status, headers, body = self.routes.get(path, (404, {}, b"not here"))
        head = f"HTTP/1.1 {status} X\r\nConnection: close\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if "Content-Length" not in headers:
            head += f"Content-Length: {len(body)}\r\n"
        await stream.send_all(head.encode() + b"\r\n" + body)
        await stream.aclose()


@asynccontextmanager
async def web_server() -> AsyncIterator[WebServer]:
    server = WebServer()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
        server.port = listeners[0].socket.getsockname()[1]
        yield server
        nursery.cancel_scope.cancel()
