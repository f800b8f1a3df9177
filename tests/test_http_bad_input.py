"""The HTTP contract's error answers, one table row per way a client can get it wrong.

Every row checks the status, the exact error shape, the message, the ``req_id`` echoed (null
when the body could not be parsed), and that nothing is left behind: no scope, no
registration. Rows that need a live request open it first and complete it afterwards, which
also shows that the error did not break the request for the other ranks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch

from support.engines import DEAD_SESSION, RankEngines
from support.harness import Harness, http_server, landing_pools
from trio_encode.client import LandingPool
from trio_encode.errors import MAX_MESSAGE_CHARS
from trio_encode.server.schemas import MAX_PARTS
from trio_encode.testing.images import image_uri
from trio_encode.testing.stand_in_encoder import embedding_size

MAX_BODY = 64 * 1024
GOOD_ITEM = image_uri(b"a good image" * 10)
STRAY = torch.zeros(embedding_size(1), dtype=torch.uint8)  # memory no receiver registered


@dataclass
class Ctx:
    harness: Harness
    pools: list[LandingPool]

    def send_body(self, req_id: str, rank: int = 0, **extra: Any) -> dict[str, Any]:
        slot = self.pools[rank].allocate(embedding_size(1))
        return {
            "req_id": req_id,
            "session_id": self.pools[rank].session_id,
            "buffer_address": slot.address,
            **extra,
        }


Body = bytes | dict[str, Any] | Callable[[Ctx], dict[str, Any]]


@dataclass
class Case:
    id: str
    route: str
    body: Body
    status: int
    message: str
    req_id: str | None
    open: dict[str, int] = field(default_factory=dict)
    """req_id -> receive_count: requests encoded before the call and completed after it."""
    complete_first: bool = False
    """Complete the opened requests before the call (to test a released req_id)."""
    kind: str = ""
    """The machine-readable ``"error"`` of the answer."""


def encode(req_id: str | None = "r", **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"mm_items": [GOOD_ITEM], **fields}
    if req_id is not None:
        body["req_id"] = req_id
    return body


def invalid(id: str, route: str, body: Body, message: str, req_id: str | None = "r") -> Case:
    """A 400 ``invalid_input`` row: the most common way to get the contract wrong."""
    return Case(id, route, body, 400, message, req_id, kind="invalid_input")


def released(id: str, route: str, body: Body) -> Case:
    """A call naming request ``done``, which completed before it: 410."""
    return Case(
        id, route, body, 410, "released", "done", {"done": 1}, complete_first=True, kind="released"
    )


def conflicting_count(id: str, route: str, body: Body) -> Case:
    """A call naming receive_count 3 for request ``live``, opened with 2: 409."""
    return Case(id, route, body, 409, "conflicts with 2", "live", {"live": 2}, kind="conflict")


CASES = [
    invalid("malformed-json", "/encode", b'{"req_id": "r", ', "not valid JSON", None),
    invalid("empty-body", "/encode", b"", "not valid JSON", None),
    invalid("not-an-object", "/send", b'["r"]', "JSON object", None),
    invalid("not-utf8", "/encode", b"\xff\xfe{}", "not valid JSON", None),
    invalid("missing-req-id", "/encode", encode(None), "req_id: Field required", None),
    invalid(
        "req-id-not-a-string",
        "/encode",
        encode(7),  # type: ignore[arg-type]
        "req_id",
        None,
    ),
    invalid("req-id-empty", "/encode", encode(""), "req_id", None),
    invalid("req-id-too-long", "/encode", encode("x" * 257), "at most 256", None),
    invalid("missing-mm-items", "/encode", {"req_id": "r"}, "mm_items: Field required"),
    invalid("mm-items-empty", "/encode", encode(mm_items=[]), "mm_items"),
    invalid("mm-items-not-strings", "/encode", encode(mm_items=[1]), "mm_items.0"),
    invalid("mm-item-garbage", "/encode", encode(mm_items=["hello"]), "mm_items[0]"),
    invalid(
        "mm-item-bad-base64", "/encode", encode(mm_items=["data:image/png;base64,@@@"]), "base64"
    ),
    invalid("receive-count-zero", "/encode", encode(receive_count=0), "receive_count"),
    invalid("receive-count-string", "/encode", encode(receive_count="4"), "receive_count"),
    invalid("modality-text", "/encode", encode(modality="TEXT"), "MULTI_IMAGES, VIDEO, AUDIO"),
    # Quoted, a client's string shows its first characters and its length, never all of it.
    invalid("modality-huge", "/encode", encode(modality="V" * 50_000), "... (50000 chars)"),
    # Integers that reach a completion message are bounded, however many digits they have.
    invalid("num-parts-huge", "/encode", encode(num_parts=2**2100), "num_parts"),
    invalid("num-parts-over-max", "/encode", encode(num_parts=MAX_PARTS + 1), f"{MAX_PARTS}"),
    invalid("part-idx-huge", "/encode", encode(num_parts=2, part_idx=2**2100), "part_idx"),
    invalid(
        "send-part-idx-huge",
        "/send",
        {"req_id": "r", "session_id": "h:1", "buffer_address": 4096, "part_idx": 2**2100},
        "part_idx",
    ),
    invalid(
        "pull-part-idx-huge",
        "/scheduler_receive_meta_data",
        {"req_id": "r", "part_idx": 2**2100},
        "part_idx",
    ),
    Case(
        "body-too-large",
        "/encode",
        encode(mm_items=[image_uri(b"x" * MAX_BODY)]),
        413,
        f"larger than this server accepts: at most {MAX_BODY} bytes (64KiB)",
        None,
        kind="too_large",
    ),
    invalid(
        "send-missing-address", "/send", {"req_id": "r", "session_id": "h:1"}, "buffer_address"
    ),
    invalid(
        "send-address-zero",
        "/send",
        {"req_id": "r", "session_id": "h:1", "buffer_address": 0},
        "buffer_address",
    ),
    invalid(
        "send-address-string",
        "/send",
        {"req_id": "r", "session_id": "h:1", "buffer_address": "0x10"},
        "buffer_address",
    ),
    invalid(
        "send-session-no-port",
        "/send",
        {"req_id": "r", "session_id": "localhost", "buffer_address": 4096},
        "host:port",
    ),
    invalid(
        "send-session-port-out-of-range",
        "/send",
        {"req_id": "r", "session_id": "127.0.0.1:70000", "buffer_address": 4096},
        "host:port",
    ),
    Case(
        "send-unknown-req-id",
        "/send",
        lambda c: c.send_body("nobody"),
        404,
        "no /encode",
        "nobody",
        kind="unknown_request",
    ),
    released("send-released-req-id", "/send", lambda c: c.send_body("done")),
    released("encode-released-req-id", "/encode", encode("done")),
    Case(
        "send-dead-session",
        "/send",
        lambda c: {**c.send_body("live"), "session_id": DEAD_SESSION},
        502,
        "transfer failed with code -1",
        "live",
        open={"live": 1},
        kind="engine_failed",
    ),
    Case(
        "send-unregistered-buffer",
        "/send",
        lambda c: {**c.send_body("live"), "buffer_address": STRAY.data_ptr()},
        502,
        "transfer failed with code -1",
        "live",
        open={"live": 2},
        kind="engine_failed",
    ),
    conflicting_count(
        "send-conflicting-receive-count", "/send", lambda c: c.send_body("live", receive_count=3)
    ),
    conflicting_count(
        "encode-conflicting-receive-count", "/encode", encode("live", receive_count=3)
    ),
    Case(
        "encoder-fails",
        "/encode",
        encode("f", mm_items=[image_uri(b"FAIL")]),
        500,
        "failed",
        "f",
        kind="encode_failed",
    ),
]


async def _complete(ctx: Ctx, req_id: str, receive_count: int) -> None:
    for rank in range(receive_count):
        sent = await ctx.harness.client.send(**ctx.send_body(req_id, rank))
        assert sent.receivers_done == rank + 1


async def _post(harness: Harness, route: str, body: bytes | dict[str, Any]) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=harness.running.url) as http:
        return await http.post(route, content=raw, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
async def test_bad_input_gets_a_contract_error_and_leaves_nothing(
    rank_engines: RankEngines, case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_encode.access")
    async with (
        http_server(rank_engines.server, max_body_bytes=MAX_BODY) as harness,
        landing_pools(rank_engines, 16 * embedding_size(1)) as pools,
    ):
        ctx = Ctx(harness, pools)
        for req_id, receive_count in case.open.items():
            await harness.client.encode(req_id, [GOOD_ITEM], receive_count=receive_count)
            if case.complete_first:
                await _complete(ctx, req_id, receive_count)
        body = case.body(ctx) if callable(case.body) else case.body

        caplog.clear()
        response = await _post(harness, case.route, body)

        assert response.status_code == case.status, response.text
        (access,) = [r for r in caplog.records if r.name == "trio_encode.access"]
        assert getattr(access, "req_id", None) == case.req_id  # the same id as the answer
        answer = response.json()
        engine_fields = {"engine_call", "engine_code", "engine_meaning"}
        shape = {"status", "error", "message", "req_id"}
        assert set(answer) == shape | (engine_fields if case.kind == "engine_failed" else set())
        assert (answer["status"], answer["error"]) == ("error", case.kind)
        if case.kind == "engine_failed":
            assert (answer["engine_call"], answer["engine_code"]) == ("transfer", -1)
            assert "registered" in answer["engine_meaning"]
        assert case.message in answer["message"]
        assert "Traceback" not in answer["message"]
        assert len(answer["message"]) <= MAX_MESSAGE_CHARS + 40  # the server's words, bounded
        assert answer["req_id"] == case.req_id
        if not case.complete_first:
            for req_id, receive_count in case.open.items():
                await _complete(ctx, req_id, receive_count)
        text = await harness.settled()
        assert f'route="{case.route}",status="{case.status}"' in text


async def test_routes_outside_the_contract_answer_in_its_error_shape(
    rank_engines: RankEngines,
) -> None:
    async with (
        http_server(rank_engines.server) as harness,
        httpx.AsyncClient(base_url=harness.running.url) as http,
    ):
        missing = await http.get("/nope")
        wrong_method = await http.get("/encode")
        assert (missing.status_code, wrong_method.status_code) == (404, 405)
        assert (missing.json()["error"], wrong_method.json()["error"]) == (
            "no_route",
            "method_not_allowed",
        )
        for response in (missing, wrong_method):
            assert response.json()["status"] == "error"
            assert response.json()["req_id"] is None


async def test_a_token_guards_encode_and_send_but_not_health_or_metrics(
    rank_engines: RankEngines,
) -> None:
    async with (
        http_server(rank_engines.server, token="s3cret", shutdown_grace=0.1) as harness,
        httpx.AsyncClient(base_url=harness.running.url) as http,
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = await http.post("/encode", json=encode(), headers=headers)
            assert response.status_code == 401
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert response.json() == {
                "status": "error",
                "error": "unauthorized",
                "message": "missing or wrong bearer token (Authorization: Bearer ...)",
                "req_id": None,
            }
        for probe in ("/health", "/livez", "/readyz"):
            assert (await http.get(probe)).status_code == 200
        assert (await http.get("/metrics")).status_code == 200
        encoded = await harness.client.encode("authed", [GOOD_ITEM])  # the client has the token
        assert encoded.receive_count is None  # no call has named it yet
        await harness.running.service.shutdown()  # ends the open scope: nothing is left
        assert harness.running.service.ledger.live_registrations == 0
