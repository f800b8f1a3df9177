"""The HTTP layer's containment: what one connection raises, or what one client uploads, stays
with that connection or client.

Against a real server on loopback (hypercorn, quart-trio, the real Mooncake engine): a failure
injected into one connection's server task closes that connection only; bodies in flight share
one budget, and one client holds at most half of it.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
import trio

from support.engines import RankEngines
from support.harness import http_server
from trio_encode.server import connections
from trio_encode.testing.images import image_uri
from trio_encode.testing.stand_in_encoder import StandInEncoder

_HYPERCORN_SERVER = connections._Connection


class _FailsWhenArmed:
    """The per-connection server, except that the next connection's raises once
    ``armed`` is set."""

    armed = False

    def __init__(self, *args: Any) -> None:
        self.first, type(self).armed = type(self).armed, False
        self.real = _HYPERCORN_SERVER(*args)

    def __await__(self) -> Any:
        return self.run().__await__()

    async def run(self) -> None:
        if self.first:
            raise RuntimeError("injected: a connection task's bug")
        await self.real.run()


def _exchange(port: int, request: bytes) -> bytes:
    """The first bytes answered to ``request`` on a new connection (b"": closed unanswered)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        try:
            return sock.recv(65536)
        except ConnectionResetError:
            return b""


async def test_a_connection_whose_server_task_raises_ends_alone(
    rank_engines: RankEngines, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(connections, "_Connection", _FailsWhenArmed)
    # Its request is never sent: no grace for it at the end (30 s by default).
    async with http_server(rank_engines.server, shutdown_grace=0.0) as harness:
        port = int(harness.running.url.rsplit(":", 1)[1])
        probe = b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"
        # This connection's task raises: it is closed without an answer...
        _FailsWhenArmed.armed = True
        assert await trio.to_thread.run_sync(_exchange, port, probe) == b""
        # ...and the server, its other connections and its requests go on.
        answer = await trio.to_thread.run_sync(_exchange, port, probe)
        assert answer.startswith(b"HTTP/1.1 200")
        report = await harness.client.encode("after", [image_uri(b"an image")])
        assert report.embedding_size > 0
        metrics = await harness.client.metrics()
        assert 'trio_encode_connection_failures_total{kind="RuntimeError"} 1.0' in metrics
    failures = [r for r in caplog.records if r.name == "trio_encode.server.connections"]
    assert len(failures) == 1
    assert "RuntimeError" in failures[0].getMessage()


async def test_bodies_in_flight_share_one_budget_and_one_client_holds_half(
    rank_engines: RankEngines,
) -> None:
    body = json.dumps({"req_id": "slow-1", "mm_items": [image_uri(b"SLOW" + b"x" * 40_000)]})
    size = len(body)
    # Room for two bodies in all: one client may hold one at a time (half the budget).
    budget = 2 * size + size // 2
    encoder = StandInEncoder(slow_seconds=2.0)
    async with (
        http_server(
            rank_engines.server, encoder, max_bodies_in_flight_bytes=budget, shutdown_grace=0.0
        ) as harness,
        httpx.AsyncClient(base_url=harness.running.url, timeout=30) as http,
    ):
        answers: dict[str, httpx.Response] = {}

        async def post(req_id: str) -> None:
            content = body.replace("slow-1", req_id)
            answers[req_id] = await http.post("/encode", content=content)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, "slow-1")
            await trio.sleep(0.5)  # its body is held while it encodes
            nursery.start_soon(post, "slow-2")
        assert answers["slow-1"].status_code == 200
        refused = answers["slow-2"]
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == "overloaded"
        assert "max_bodies_in_flight_bytes" in refused.json()["message"]
        assert refused.headers["Retry-After"] == "1"
        # Answered, the first one's bytes are free again.
        again = await http.post("/encode", content=body.replace("slow-1", "slow-3"))
        assert again.status_code == 200, again.text
