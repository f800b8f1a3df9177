"""The pulls, ``/send`` and the probes are served by a small ASGI layer in front of Quart
(:class:`trio_encode.server.app._FastRoutes`): per call it costs a fraction of Quart's request
and response objects, hooks and dispatch. It must answer exactly as Quart's own path does: the
same status, headers and body bytes, the same access log line and the same metrics, for answers
and for refusals alike. Each case here is sent to the app as ``serve`` builds it and to the same
app with the layer taken out (Quart's views of the same routes answering).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio

from trio_encode.server.app import _BODY_END, _CUT, _BodyLimits, _FastRoutes, create_app
from trio_encode.server.metrics import Metrics
from trio_encode.service import EncodeService, ServiceSettings
from trio_encode.settings import ServerSettings
from trio_encode.testing.memory_engine import InMemoryEngine, InMemoryFabric
from trio_encode.testing.stand_in_encoder import StandInEncoder

TOKEN = "sesame"
LIMIT = 4096
MAX_BODY = 2 * LIMIT
"""``max_body_bytes`` here: a control body past it is refused as the route's (413 with the
route's limit), never by Quart's own bound for images, on either path."""
_SEND = {"req_id": "r1", "session_id": "127.0.0.1:9", "buffer_address": 4096}


class _Loaded(StandInEncoder):
    ready = True


def _bodies(**fields: Any) -> bytes:
    return json.dumps(_SEND | fields).encode()


def _declared(path: str, size: int) -> tuple[str, str, bytes, dict[str, str]]:
    """A body of ``size`` bytes that says so (the test client declares no length itself)."""
    return ("POST", path, b" " * size, {"auth": "yes", "Content-Length": str(size)})


# (method, path, body, headers): each a different path through the layer.
CASES: dict[str, tuple[str, str, bytes | None, dict[str, str]]] = {
    "health": ("GET", "/health", None, {}),
    "livez": ("GET", "/livez", None, {}),
    "readyz": ("GET", "/readyz", None, {}),
    "pull-not-json": ("POST", "/scheduler_receive_meta_data", b"{nope", {"auth": "yes"}),
    "pull-no-token": ("POST", "/scheduler_receive_meta_data", b"{}", {}),
    "send-wrong-token": ("POST", "/send", _bodies(), {"Authorization": "Bearer nope"}),
    "send-declared-too-large": _declared("/send", LIMIT + 1),
    "send-declared-past-max-body": _declared("/send", MAX_BODY + 1),
    "send-invalid": ("POST", "/send", _bodies(buffer_address="5"), {"auth": "yes"}),
    "send-receiver-not-allowed": (
        "POST",
        "/send",
        _bodies(session_id="10.1.2.3:9"),
        {"auth": "yes"},
    ),
    "send-bad-endpoint": (
        "POST",
        "/send",
        _bodies(prefill_host="bad host", embedding_port=5),
        {"auth": "yes"},
    ),
    "send-unknown": ("POST", "/send", _bodies(), {"auth": "yes"}),
}


async def _answers(
    ready: bool, layered: bool, caplog: pytest.LogCaptureFixture
) -> tuple[dict[str, tuple[int, dict[str, str], bytes, tuple[Any, ...]]], str]:
    """Every case's status, headers, body and access log fields; then the metrics' text."""
    answers = {}
    async with trio.open_nursery() as nursery:
        metrics = Metrics()
        service = EncodeService(
            nursery=nursery,
            engine=InMemoryEngine(InMemoryFabric(), "127.0.0.1:1"),
            encoder=_Loaded() if ready else StandInEncoder(),
            settings=ServiceSettings(pull_timeout=0.5),
            observer=metrics,
        )
        settings = ServerSettings.exactly(
            token=TOKEN, max_control_body_bytes=LIMIT, max_body_bytes=MAX_BODY
        )
        app = create_app(service, metrics, settings)
        limited = app.asgi_app
        assert isinstance(limited, _BodyLimits)
        assert isinstance(limited.app, _FastRoutes)
        if not layered:
            limited.app = limited.app.app  # Quart's own asgi_app: its views answer
        client = app.test_client()
        for name, (method, path, body, headers) in CASES.items():
            if headers.pop("auth", None) is not None or "Authorization" in headers:
                headers.setdefault("Authorization", f"Bearer {TOKEN}")
            caplog.clear()
            response = await client.open(path, method=method, data=body, headers=headers)
            (line,) = [r for r in caplog.records if r.name == "trio_encode.access"]
            fields = ("method", "path", "status", "bytes", "req_id")
            logged = tuple(getattr(line, key) for key in fields)
            kept = {k.lower(): v for k, v in response.headers.items() if k.lower() != "date"}
            answers[name] = (response.status_code, kept, await response.get_data(), logged)
        text = metrics.render().decode()
        nursery.cancel_scope.cancel()
    counted = "\n".join(
        line
        for line in text.splitlines()
        if line.startswith(("trio_encode_requests_total", "trio_encode_request_seconds_count"))
    )
    return answers, counted


@pytest.mark.parametrize("ready", [True, False], ids=["ready", "loading"])
def test_the_fast_routes_answer_log_and_count_exactly_as_quart_does(
    ready: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_encode.access")
    fast, fast_counted = trio.run(_answers, ready, True, caplog)
    quart, quart_counted = trio.run(_answers, ready, False, caplog)
    assert fast.keys() == quart.keys() == CASES.keys()
    for name in CASES:
        assert fast[name] == quart[name], name
    statuses = {name: answer[0] for name, answer in fast.items()}
    assert statuses == {
        "health": 200 if ready else 503,
        "livez": 200,
        "readyz": 200 if ready else 503,
        "pull-not-json": 400,
        "pull-no-token": 401,
        "send-wrong-token": 401,
        "send-declared-too-large": 413,
        "send-declared-past-max-body": 413,
        "send-invalid": 400,
        "send-receiver-not-allowed": 403,
        "send-bad-endpoint": 400,
        "send-unknown": 404,
    }
    assert fast["send-wrong-token"][1]["www-authenticate"] == "Bearer"
    for name in ("send-declared-too-large", "send-declared-past-max-body"):
        message = json.loads(fast[name][2])["message"]
        assert message == f"/send takes bodies of at most {LIMIT} bytes", name
    assert fast["send-receiver-not-allowed"][3][4] == "r1"  # the access log names the req_id
    assert fast_counted == quart_counted
    assert 'route="/send",status="401"' in fast_counted


@pytest.mark.parametrize(
    ("path", "declared", "cut"),
    [
        ("/send", b"4097", True),
        ("/send", b"9" * 25, True),  # past 20 digits: over every limit, not converted whole
        ("/send", b"4096", False),
        ("/encode", b"4097", False),  # an image route: only the budget bounds it
    ],
)
def test_a_control_body_declared_past_its_limit_is_cut_before_a_byte_is_read(
    path: str, declared: bytes, cut: bool
) -> None:
    """The route's limit is decided in one place, :class:`_BodyLimits`, from the declared
    length before the body is read (the handler then refuses it), so a client cannot make the
    server wait for, or hold, a body it already said is too long."""
    chunk = {"type": "http.request", "body": b"{}", "more_body": False}
    seen: list[tuple[dict[str, Any], bool]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((await receive(), bool(scope.get(_CUT))))

    async def receive() -> dict[str, Any]:
        assert not cut, "read a body its declared length had already refused"
        return chunk

    scope = {
        "type": "http",
        "path": path,
        "client": ("127.0.0.1", 1),
        "headers": [(b"content-length", declared)],
    }
    trio.run(_BodyLimits(app, control_limit=LIMIT, budget=1 << 20), scope, receive, None)
    assert seen == [(_BODY_END, True)] if cut else [(chunk, False)]
