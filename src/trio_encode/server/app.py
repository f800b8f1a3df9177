"""The quart-trio app: the routes of the HTTP contract, each a few lines.

A handler parses its body, calls the service, and maps the result; failures are mapped in
:mod:`trio_encode.server.errors`. Nothing here touches a scope, an engine or a tensor, so a
handler cancelled by a disconnecting client leaves only what the service decides to keep.

Auth: when a token is set, ``/encode``, ``/send`` and ``/scheduler_receive_meta_data`` need
``Authorization: Bearer <token>``. The probes and ``/metrics`` stay open, because probes and
scrapers rarely carry secrets and none of them reveals request data, the transfer engine's
address or changes state.

Bodies: only ``/encode`` carries images; every other route takes at most
``max_control_body_bytes``, refused (413) from its ``Content-Length`` or as soon as more
arrives (:class:`_BodyLimits`, in front of the app), so a stream of junk to ``/send`` is
never buffered; all bodies in flight together hold at most ``max_bodies_in_flight_bytes`` (503
beyond it). A ``/send`` may name only a receiver host in ``allowed_receivers`` (403 otherwise,
before anything is looked up), and each client (by address) has at most
``max_sends_per_client`` ``/send`` calls in flight (503).

Every answer is counted and timed by route; with ``access_log`` on, it is also logged as one
line on the ``trio_encode.access`` logger.
"""

from __future__ import annotations

import hmac
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from quart import Response, g, jsonify, request
from quart_trio import QuartTrio

from trio_encode.errors import (
    NotReady,
    Overloaded,
    ReceiverNotAllowed,
    ShuttingDown,
    TooLarge,
    clip,
)
from trio_encode.receivers import receiver_host
from trio_encode.request_types import Receiver
from trio_encode.server.errors import error_response, install_error_handlers, unauthorized
from trio_encode.server.metrics import Metrics
from trio_encode.server.schemas import (
    EncodeRequest,
    PullRequest,
    SendRequest,
    encode_answer,
    parse_body,
    pull_answer,
    send_answer,
)
from trio_encode.service import EncodeService, Notify, Part
from trio_encode.settings import ServerSettings

_PROTECTED = frozenset({"/encode", "/send", "/scheduler_receive_meta_data"})
_IMAGE_ROUTES = frozenset({"/encode"})
"""The only routes whose bodies may reach ``max_body_bytes``."""

access_log = logging.getLogger("trio_encode.access")

_CUT = "trio_encode.body_cut"
"""The ASGI scope's key set when :class:`_BodyLimits` cut a body at its route's limit."""
_PARSED_ASIDE_BYTES = 1 << 20
"""An /encode body larger than this is parsed in a worker thread, one at a time: scanning and
validating tens of MB of JSON takes a tenth of a second or more, which the event loop (every
other request's answers) must not wait for. The parser holds the GIL for one C call at a time,
so the loop waits at most for the longest of them, not for the sum."""
_BODY_END = {"type": "http.request", "body": b"", "more_body": False}
_OVER_BUDGET = "trio_encode.body_over_budget"
"""The ASGI scope's key set when :class:`_BodyLimits` refused a body over the total budget."""


class _BodyLimits:
    """ASGI middleware: what request bodies may cost, counted as their bytes stream in.

    Per route: the body of every route but the image routes ends at ``control_limit`` bytes.
    Quart buffers a body as it arrives, up to the app-wide ``MAX_CONTENT_LENGTH`` (sized for
    images), and has no public per-route bound on that buffer.

    In total: every request reserves its body's bytes from one budget (``budget``; one client
    address at most half of it) for as long as its handler runs, since the handler holds the
    body until it answers. A declared ``Content-Length`` is reserved before a byte is read; a
    chunked body as it arrives.

    A body over either bound is not handed on: the app sees it end there, and the scope says
    why (:data:`_CUT` or :data:`_OVER_BUDGET`; the handler answers 413 or 503). Whatever the
    client still sends is read and dropped, never kept."""

    def __init__(
        self, app: Callable[..., Awaitable[None]], *, control_limit: int, budget: int
    ) -> None:
        self.app = app
        self.control_limit = control_limit
        self.budget = budget
        self.held = 0
        self._held_by: Counter[str] = Counter()

    def _reserve(self, client: str, nbytes: int) -> bool:
        if self.held + nbytes > self.budget or 2 * (self._held_by[client] + nbytes) > self.budget:
            return False
        self.held += nbytes
        self._held_by[client] += nbytes
        return True

    def _release(self, client: str, nbytes: int) -> None:
        self.held -= nbytes
        self._held_by[client] -= nbytes
        if not self._held_by[client]:
            del self._held_by[client]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = None if scope["path"] in _IMAGE_ROUTES else self.control_limit
        client = scope["client"][0] if scope.get("client") else "unknown"
        declared = _content_length(scope)
        reserved = 0
        if declared and (limit is None or declared <= limit):
            if self._reserve(client, declared):
                reserved = declared
            else:
                scope[_OVER_BUDGET] = True
        received = 0

        def refused() -> bool:
            return bool(scope.get(_CUT) or scope.get(_OVER_BUDGET))

        told_end = False

        async def counted() -> dict[str, Any]:
            nonlocal received, reserved, told_end
            if refused() and not told_end:  # refused before a byte was read
                told_end = True
                return _BODY_END
            message: dict[str, Any] = await receive()
            while refused() and message["type"] == "http.request":
                message = await receive()  # the rest of a refused body: read and dropped
            if message["type"] != "http.request":
                return message
            received += len(message.get("body", b""))
            if limit is not None and received > limit:
                scope[_CUT] = True
            elif received > reserved:
                if self._reserve(client, received - reserved):
                    reserved = received
                else:
                    scope[_OVER_BUDGET] = True
            if refused():
                told_end = True
                return _BODY_END
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            self._release(client, reserved)


def _content_length(scope: Any) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() and len(value) <= 19 else None
    return None


def create_app(service: EncodeService, metrics: Metrics, settings: ServerSettings) -> Any:
    """Build the app serving ``service``; metrics count every answer."""
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    limited = _BodyLimits(
        app.asgi_app,
        control_limit=settings.max_control_body_bytes,
        budget=settings.max_bodies_in_flight_bytes,
    )
    app.asgi_app = limited  # type: ignore[method-assign]  # Quart's documented middleware hook
    install_error_handlers(app)
    expected = f"Bearer {settings.token}".encode() if settings.token else None
    sends_in_flight: Counter[str] = Counter()
    parsing = trio.CapacityLimiter(1)
    receivers = settings.receiver_policy

    @app.before_request
    async def check_token() -> Response | None:
        g.arrived = trio.current_time()
        if expected is None or request.path not in _PROTECTED:
            return None
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, expected):
            return None
        return unauthorized()

    @app.before_request
    async def limit_body() -> None:
        if request.path in _IMAGE_ROUTES:
            return
        limit = settings.max_control_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise TooLarge(f"{request.path} takes bodies of at most {limit} bytes")
        request.max_content_length = limit  # what a 413 of Quart's own names

    async def read_body() -> bytes:
        data: bytes = await request.get_data(cache=False, as_text=False, parse_form_data=False)
        if request.scope.get(_OVER_BUDGET):
            raise Overloaded(
                f"request bodies in flight are at max_bodies_in_flight_bytes "
                f"({settings.max_bodies_in_flight_bytes} bytes; one client at most half); "
                "retry when some have been answered"
            )
        if request.scope.get(_CUT):
            raise TooLarge(
                f"{request.path} takes bodies of at most {settings.max_control_body_bytes} bytes"
            )
        return data

    @app.after_request
    async def count(response: Response) -> Response:
        route = request.url_rule.rule if request.url_rule is not None else "other"
        # A request Quart refused before any before_request ran has no arrival time: 0 s.
        seconds = trio.current_time() - g.get("arrived", trio.current_time())
        metrics.request_answered(route, response.status_code, seconds)
        if settings.access_log:
            access_log.info(
                "answered",
                extra={
                    "method": request.method,
                    "path": request.path,
                    "status": response.status_code,
                    "duration_ms": round(seconds * 1000, 3),
                    "bytes": response.content_length or 0,
                    "req_id": g.get("req_id"),
                },
            )
        return response

    def refuse_unless_allowed(host: str, what: str, req_id: str) -> None:
        if not receivers.allows(host):
            raise ReceiverNotAllowed(
                f"{what} host {clip(host)} is not one this server sends to (allowed_receivers)",
                req_id=req_id,
            )

    @app.post("/encode")
    async def encode() -> Response:
        raw = await read_body()
        if len(raw) > _PARSED_ASIDE_BYTES:  # megabytes of JSON: not on the event loop
            body = await trio.to_thread.run_sync(parse_body, EncodeRequest, raw, limiter=parsing)
        else:
            body = parse_body(EncodeRequest, raw)
        g.req_id = body.req_id
        for endpoint in body.endpoints:  # the server pushes to them: receivers' rules apply
            refuse_unless_allowed(endpoint.host, "prefill_host", body.req_id)
        part = Part(body.num_parts or 1, body.part_idx or 0, body.endpoints)
        report = await service.encode(
            body.req_id,
            body.urls,
            receive_count=body.receive_count,
            part=part,
            prefill_host=body.prefill_host,
            client=request.remote_addr or "unknown",
        )
        return jsonify(encode_answer(body, report))

    @app.post("/scheduler_receive_meta_data")
    async def pull() -> Response:
        body = parse_body(PullRequest, await read_body())
        g.req_id = body.req_id
        report = await service.pull(body.req_id, receive_count=body.receive_count)
        return jsonify(pull_answer(body, report))

    @app.post("/send")
    async def send() -> Response:
        body = parse_body(SendRequest, await read_body())
        g.req_id = body.req_id
        refuse_unless_allowed(receiver_host(body.session_id), "receiver", body.req_id)
        if body.endpoint is not None:  # its completion message goes there
            refuse_unless_allowed(body.endpoint.host, "prefill_host", body.req_id)
        client = request.remote_addr or "unknown"
        if sends_in_flight[client] >= settings.max_sends_per_client:
            raise Overloaded(
                f"this client already has {settings.max_sends_per_client} /send calls in "
                "flight (max_sends_per_client); retry when one has answered",
                req_id=body.req_id,
            )
        sends_in_flight[client] += 1
        try:
            receiver = Receiver(body.session_id, body.buffer_address)
            report = await service.send(
                body.req_id,
                receiver,
                receive_count=body.receive_count,
                notify=None if body.endpoint is None else Notify(body.endpoint, body.part_idx or 0),
                client=client,
            )
        finally:
            sends_in_flight[client] -= 1
            if not sends_in_flight[client]:
                del sends_in_flight[client]
        return jsonify(send_answer(body.req_id, report))

    def not_ready() -> Response | None:
        """The 503 answer while the service cannot take requests; None when it can."""
        if service.registry.closed:
            return error_response(ShuttingDown("not ready: shutting down"))
        if not service.ready:
            return error_response(NotReady("not ready: the encoder is not loaded yet"))
        return None

    @app.get("/livez")
    async def livez() -> Response:
        # Answering at all proves the process and its event loop are alive: nothing else is
        # checked, so draining or loading never gets the process restarted.
        return jsonify({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        return not_ready() or jsonify({"status": "ok"})

    @app.get("/health")
    async def health() -> Response:
        refusal = not_ready()
        if refusal is not None:
            return refusal
        # Never the engine's session_id: whoever can reach the engine's port with it can
        # read and write the memory it registered (see docs/operations.md, Security).
        return jsonify(
            {
                "status": "ok",
                "live_scopes": len(service.registry),
                "live_registrations": service.ledger.live_registrations,
            }
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), content_type=metrics.content_type)

    return app
