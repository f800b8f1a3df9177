"""The quart-trio app: the routes of the HTTP contract, each a few lines.

A handler parses its body, calls the service, and maps the result; failures are mapped in
:mod:`trio_encode.server.errors`. The metadata pulls, ``/send`` and the probes (the calls
SGLang makes 2 x TP times per image part, and every few seconds) are served by a small ASGI
layer in front of Quart (:class:`_FastRoutes`) with the same handlers, answers, logs and
metrics: Quart's per-request machinery cost more CPU than hypercorn's own. Nothing here
touches a scope, an engine or a tensor, so a handler cancelled by a disconnecting client leaves
only what the service decides to keep.

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
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from quart import Response, g, jsonify, request
from quart_trio import QuartTrio

from trio_encode.errors import (
    NotReady,
    Overloaded,
    ReceiverNotAllowed,
    RequestError,
    ShuttingDown,
    TooLarge,
    clip,
)
from trio_encode.receivers import receiver_host
from trio_encode.request_types import Receiver
from trio_encode.server.errors import (
    error_answer,
    error_response,
    failure_of,
    http_failure,
    install_error_handlers,
    unauthorized,
)
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

    Per route: the body of every route but the image routes ends at ``control_limit`` bytes,
    whether its ``Content-Length`` says it is longer or more of it arrives. This is the only
    place that decides it, for both paths (:class:`_FastRoutes` and Quart); the handler that
    reads the body refuses it (:func:`_refuse_cut`). Quart buffers a body as it arrives, up to
    the app-wide ``MAX_CONTENT_LENGTH`` (sized for images), and has no public per-route bound
    on that buffer.

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
        if declared and limit is not None and declared > limit:
            scope[_CUT] = True
        elif declared:
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
    """The declared body length: any run of digits, as Quart reads it (None: not declared, or
    not a number). Past 20 digits it is over every limit, so the rest is not converted."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            digits = value.strip()
            return int(digits[:20]) if digits.isdigit() else None
    return None


class _Call:
    """What the fast path knows of the request it serves (Quart's ``g`` on the other path)."""

    __slots__ = ("req_id",)

    def __init__(self) -> None:
        self.req_id: str | None = None


Answer = dict[str, Any] | RequestError
"""A route's answer: the JSON of a 200, or a refusal answered as it is (not logged)."""
Handler = Callable[[Any, bytes, str], Awaitable[Answer]]
"""A route: given the request's facts (``g`` or a :class:`_Call`), its body and the client's
address."""


@dataclass(frozen=True)
class _Route:
    handler: Handler
    reads_body: bool


def _json(data: object) -> bytes:
    """The bytes Quart's ``jsonify`` writes (sorted keys, compact, ASCII, a newline), so a
    route answers alike on either path."""
    return (json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n").encode()


_JSON_TYPE = (b"content-type", b"application/json")
_DISCONNECT = "http.disconnect"


class _FastRoutes:
    """ASGI layer in front of Quart: the calls SGLang makes 2 x TP times per image part (the
    metadata pulls and ``/send``) and the probes, served without Quart's request and response
    objects, context, hooks and dispatch, which cost more than hypercorn itself per call.

    Everything the contract says of these routes stays, from the same functions the Quart
    path uses: the token, the body limits (decided by :class:`_BodyLimits` in front of both,
    refused by :func:`_refuse_cut` once the body is read), the body timeout, the error answers
    and their logs (:func:`failure_of`), the metrics and the access log line
    (:func:`_Recorder`), and a client's disconnect cancelling its handler (as quart-trio does:
    nothing is answered, counted or logged). Any other method or route goes on to Quart (405,
    404, ``HEAD``)."""

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        routes: dict[tuple[str, str], _Route],
        *,
        expected: bytes | None,
        body_timeout: float,
        response_timeout: float,
        control_limit: int,
        budget: int,
        record: _Recorder,
    ) -> None:
        self.app = app
        self.budget = budget
        self.routes = routes
        self.expected = expected
        self.body_timeout = body_timeout
        self.response_timeout = response_timeout
        self.control_limit = control_limit
        self.record = record

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        route = self.routes.get((scope.get("method"), scope.get("path")))
        if route is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived = trio.current_time()
        call = _Call()
        client = scope["client"][0] if scope.get("client") else "unknown"
        path = scope["path"]
        answer: Answer
        try:
            refusal = self._unauthorized(scope, path)
            if refusal is not None:
                answer = refusal
            elif not route.reads_body:  # a probe: its handler never waits
                answer = await route.handler(call, b"", client)
            else:
                with trio.CancelScope() as serving:
                    answer = await self._serve(route, scope, receive, call, client, serving)
                if serving.cancelled_caught:
                    return  # the client went away: quart-trio answers nothing either
        except Exception as exc:
            answer = failure_of(exc, call)
        if isinstance(answer, RequestError):
            status, body, more = error_answer(answer)
            data = _json(body)
            headers = [_JSON_TYPE, (b"content-length", b"%d" % len(data))]
            headers += [(name.encode(), value.encode()) for name, value in more]
        else:
            status, data = 200, _json(answer)
            headers = [_JSON_TYPE, (b"content-length", b"%d" % len(data))]
        self.record(
            scope["method"], path, path, status, trio.current_time() - arrived, len(data), call
        )
        with trio.move_on_after(self.response_timeout):
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": data, "more_body": False})

    def _unauthorized(self, scope: Any, path: str) -> RequestError | None:
        """The refusal made before a byte of the body is read (as Quart's hook does): a
        protected route without the token."""
        if self.expected is None or path not in _PROTECTED:
            return None
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        return None if hmac.compare_digest(given, self.expected) else unauthorized()

    async def _serve(
        self,
        route: _Route,
        scope: Any,
        receive: Any,
        call: _Call,
        client: str,
        serving: trio.CancelScope,
    ) -> Answer:
        """Read the body, then run the handler while a disconnect cancels ``serving``."""
        chunks = []
        with trio.move_on_after(self.body_timeout) as waiting:
            while True:
                message = await receive()
                if message["type"] == _DISCONNECT:
                    serving.cancel()
                    await trio.lowlevel.checkpoint()
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        if waiting.cancelled_caught:
            raise http_failure(408)
        raw = b"".join(chunks)
        _refuse_cut(scope, scope["path"], self.control_limit, self.budget)
        failed: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, serving)
            try:
                answer = await route.handler(call, raw, client)
            except Exception as exc:  # raised here, not from the nursery (no exception group)
                failed = exc
            nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed
        return answer


async def _cancel_on_disconnect(receive: Any, serving: trio.CancelScope) -> None:
    while (await receive())["type"] != _DISCONNECT:
        pass
    serving.cancel()


def _refuse_cut(scope: Any, path: str, control_limit: int, budget: int) -> None:
    """What :class:`_BodyLimits` decided about this body, once read: over the budget (503)
    or over the route's limit (413). The one place either is refused, on both paths."""
    if scope.get(_OVER_BUDGET):
        raise Overloaded(
            f"request bodies in flight are at max_bodies_in_flight_bytes ({budget} bytes; one "
            "client at most half); retry when some have been answered"
        )
    if scope.get(_CUT):
        raise TooLarge(f"{path} takes bodies of at most {control_limit} bytes")


class _Recorder:
    """Counts and times every answer by route; with ``access_log`` on, logs it as one line."""

    def __init__(self, metrics: Metrics, access: bool) -> None:
        self.metrics = metrics
        self.access = access

    def __call__(
        self,
        method: str,
        path: str,
        route: str,
        status: int,
        seconds: float,
        nbytes: int,
        call: Any,
    ) -> None:
        self.metrics.request_answered(route, status, seconds)
        if self.access:
            fields = {
                "method": method,
                "path": path,
                "status": status,
                "duration_ms": round(seconds * 1000, 3),
                "bytes": nbytes,
                "req_id": getattr(call, "req_id", None),
            }
            modality = getattr(call, "modality", None)  # an /encode's, once its body parsed
            if modality is not None:
                fields["modality"] = modality
            access_log.info("answered", extra=fields)


def create_app(service: EncodeService, metrics: Metrics, settings: ServerSettings) -> Any:
    """Build the app serving ``service``; metrics count every answer."""
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    install_error_handlers(app)
    expected = f"Bearer {settings.token}".encode() if settings.token else None
    sends_in_flight: Counter[str] = Counter()
    parsing = trio.CapacityLimiter(1)
    receivers = settings.receiver_policy
    record = _Recorder(metrics, settings.access_log)
    control_limit = settings.max_control_body_bytes
    budget = settings.max_bodies_in_flight_bytes

    @app.before_request
    async def check_token() -> Response | None:
        g.arrived = trio.current_time()
        if expected is None or request.path not in _PROTECTED:
            return None
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, expected):
            return None
        return error_response(unauthorized())

    async def read_body() -> bytes:
        data = b""
        if not request.scope.get(_CUT):  # a body cut before a byte was read has none to read
            data = await request.get_data(cache=False, as_text=False, parse_form_data=False)
        _refuse_cut(request.scope, request.path, control_limit, budget)
        return data

    @app.after_request
    async def count(response: Response) -> Response:
        route = request.url_rule.rule if request.url_rule is not None else "other"
        # A request Quart refused before any before_request ran has no arrival time: 0 s.
        seconds = trio.current_time() - g.get("arrived", trio.current_time())
        nbytes = response.content_length or 0
        record(request.method, request.path, route, response.status_code, seconds, nbytes, g)
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
        g.req_id, g.modality = body.req_id, body.items_are
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
            modality=body.items_are,
        )
        return jsonify(encode_answer(body, report))

    async def pull(call: Any, raw: bytes, client: str) -> Answer:
        body = parse_body(PullRequest, raw)
        call.req_id = body.req_id
        report = await service.pull(body.req_id, receive_count=body.receive_count)
        return pull_answer(body, report)

    async def send(call: Any, raw: bytes, client: str) -> Answer:
        body = parse_body(SendRequest, raw)
        call.req_id = body.req_id
        refuse_unless_allowed(receiver_host(body.session_id), "receiver", body.req_id)
        if body.endpoint is not None:  # its completion message goes there
            refuse_unless_allowed(body.endpoint.host, "prefill_host", body.req_id)
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
        return send_answer(body.req_id, report)

    def not_ready() -> RequestError | None:
        """The 503 refusal while the service cannot take requests; None when it can."""
        if service.registry.closed:
            return ShuttingDown("not ready: shutting down")
        if not service.ready:
            return NotReady("not ready: the encoder is not loaded yet")
        return None

    async def livez(call: Any, raw: bytes, client: str) -> Answer:
        # Answering at all proves the process and its event loop are alive: nothing else is
        # checked, so draining or loading never gets the process restarted.
        return {"status": "ok"}

    async def readyz(call: Any, raw: bytes, client: str) -> Answer:
        return not_ready() or {"status": "ok"}

    async def health(call: Any, raw: bytes, client: str) -> Answer:
        refusal = not_ready()
        if refusal is not None:
            return refusal
        # Never the engine's session_id: whoever can reach the engine's port with it can
        # read and write the memory it registered (see docs/operations.md, Security).
        return {
            "status": "ok",
            "live_scopes": len(service.registry),
            "live_registrations": service.ledger.live_registrations,
        }

    routes = {
        ("POST", "/scheduler_receive_meta_data"): _Route(pull, reads_body=True),
        ("POST", "/send"): _Route(send, reads_body=True),
        ("GET", "/livez"): _Route(livez, reads_body=False),
        ("GET", "/readyz"): _Route(readyz, reads_body=False),
        ("GET", "/health"): _Route(health, reads_body=False),
    }
    for (method, path), route in routes.items():
        # Quart keeps each route too: its other methods (405, HEAD) are Quart's to answer.
        app.add_url_rule(path, path, _quart_view(route, read_body), methods=[method])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), content_type=metrics.content_type)

    fast = _FastRoutes(
        app.asgi_app,
        routes,
        expected=expected,
        body_timeout=float(app.config["BODY_TIMEOUT"]),
        response_timeout=float(app.config["RESPONSE_TIMEOUT"]),
        control_limit=control_limit,
        budget=budget,
        record=record,
    )
    limited = _BodyLimits(fast, control_limit=control_limit, budget=budget)
    app.asgi_app = limited  # type: ignore[method-assign]  # Quart's documented middleware hook
    return app


def _quart_view(route: _Route, read_body: Callable[[], Awaitable[bytes]]) -> Any:
    """``route`` as a Quart view (for what reaches Quart: ``HEAD`` of a probe)."""

    async def view() -> Response:
        raw = await read_body() if route.reads_body else b""
        answer = await route.handler(g, raw, request.remote_addr or "unknown")
        return error_response(answer) if isinstance(answer, RequestError) else jsonify(answer)

    return view
