"""Pushes completion messages to prefill ranks over ZMQ without blocking the event loop.

One PUSH socket per endpoint (``tcp://host:port``), reused by every message to it, closed
after :data:`IDLE_SECONDS` unused; at most ``max_sockets`` (:data:`MAX_SOCKETS`) are open (a
new endpoint closes the least recently used idle one first). Every socket queues at most
:data:`SEND_HWM` messages, queues only to a connected peer (``ZMQ_IMMEDIATE``, so a gone host
fails the push instead of holding it) and drops what is left when it closes (linger 0).

A push never blocks: it offers the message without waiting and, while the socket cannot take
it or has not yet written it out, sleeps a little (1 ms, doubling up to 20 ms) until the
push's timeout. It counts as sent once ZMQ has written it to the connection (its tracker is
done), so closing the socket later cannot drop it. A host that is gone costs that one message
its timeout, and no thread, lock or other endpoint's message.

Error pushes (a request's failure, told to ranks a client named) may hold at most
``error_sockets`` sockets at once (a quarter of ``max_sockets`` by default), waiting in turn
for one: endpoints that nobody listens on, each held for the whole timeout, can never take the
sockets that done pushes (a rank whose bytes just landed, its ``/send`` waiting) need. They
reach the pusher through :class:`FailureNotices`, which bounds them per client as well.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import trio
import zmq

from trio_encode.errors import CompletionFailed
from trio_encode.observer import LifecycleObserver, NullObserver, TaskFaults

log = logging.getLogger(__name__)

IDLE_SECONDS = 10.0
"""An endpoint's socket unused this long is closed."""
MAX_SOCKETS = 256
"""Sockets open at once by default; beyond it the least recently used idle one is closed."""
ERROR_SHARE = 4
"""By default error pushes hold at most ``max_sockets // ERROR_SHARE`` sockets: the other
three quarters are kept for done pushes."""
SEND_HWM = 64
"""Messages one socket queues before a push to it has to wait."""
_FIRST_WAIT, _LONGEST_WAIT = 0.001, 0.02

_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


Kind = Literal["done", "error"]
"""A completion message's kind: a part's bytes landed, or why they never will."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A prefill rank's ZMQ PULL socket, as SGLang names it (``prefill_host``,
    ``embedding_port``)."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not 0 < self.port <= 65535:
            raise ValueError(f"embedding_port must be in 1..65535, got {self.port}")
        if not (_HOSTNAME.match(self.host) or self._ipv6):
            raise ValueError(f"prefill_host {self.host!r} is not a host name or address")

    @property
    def _ipv6(self) -> bool:
        try:
            return isinstance(ipaddress.ip_address(self.host), ipaddress.IPv6Address)
        except ValueError:
            return False

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if self._ipv6 else self.host
        return f"tcp://{host}:{self.port}"


@dataclass(eq=False)
class _Socket:
    endpoint: Endpoint
    socket: zmq.Socket[bytes]
    last_used: float
    users: int = 0
    lock: trio.Lock = field(default_factory=trio.Lock)


class Pusher(Protocol):
    """What the service needs of a pusher (:class:`CompletionPusher`; tests script others)."""

    async def push(self, endpoint: Endpoint, message: bytes, *, kind: Kind) -> None:
        """Deliver ``message`` or raise :class:`CompletionFailed`."""
        ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Its long-lived work, in the service nursery."""
        ...


class CompletionPusher:
    """The PUSH sockets of one server; :meth:`run` in the service nursery closes idle ones
    and, on exit, all of them."""

    def __init__(
        self,
        *,
        timeout: float,
        observer: LifecycleObserver | None = None,
        max_sockets: int = MAX_SOCKETS,
        error_sockets: int | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError("the push timeout must be positive")
        if max_sockets < 1:
            raise ValueError("max_sockets must be at least 1")
        if error_sockets is None:
            error_sockets = max(1, max_sockets // ERROR_SHARE)
        if not 1 <= error_sockets <= max_sockets:
            raise ValueError("error_sockets must be in 1..max_sockets")
        self.timeout = timeout
        self.max_sockets = max_sockets
        self._observer: LifecycleObserver = observer or NullObserver()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self._sockets: OrderedDict[Endpoint, _Socket] = OrderedDict()
        self._error_slots = trio.CapacityLimiter(error_sockets)
        """Taken by each error push for its whole life: the sockets error pushes hold."""
        self.sent = 0
        self.failed = 0

    @property
    def open_sockets(self) -> int:
        return len(self._sockets)

    @property
    def open_endpoints(self) -> list[Endpoint]:
        """The endpoints with an open socket, least recently used first."""
        return list(self._sockets)

    @property
    def error_pushes(self) -> int:
        """Error pushes holding a socket now (at most ``error_sockets``)."""
        return int(self._error_slots.borrowed_tokens)

    async def push(self, endpoint: Endpoint, message: bytes, *, kind: Kind) -> None:
        """Deliver ``message`` to ``endpoint`` within the timeout, or raise
        :class:`CompletionFailed` saying why. ``kind`` labels the count; an error push first
        waits for one of the sockets error pushes may hold (its timeout starts then)."""
        try:
            if kind == "error":
                async with self._error_slots:
                    await self._push(endpoint, message)
            else:
                await self._push(endpoint, message)
        except CompletionFailed:
            self.failed += 1
            self._observer.completion_pushed(kind, ok=False)
            raise
        self.sent += 1
        self._observer.completion_pushed(kind, ok=True)

    async def _push(self, endpoint: Endpoint, message: bytes) -> None:
        deadline = trio.current_time() + self.timeout
        entry = self._socket_for(endpoint)
        entry.users += 1
        try:
            async with entry.lock:  # one message at a time per socket, in order
                sent = await self._send(entry.socket, message, deadline)
        finally:
            entry.users -= 1
            entry.last_used = trio.current_time()
        if not sent:
            if entry.users == 0:
                # What it still holds is stale: the next message starts a fresh connection.
                self._close(entry)
            raise CompletionFailed(
                f"no prefill rank took the completion message at {endpoint.address} within "
                f"{self.timeout:g} s"
            )

    @staticmethod
    async def _send(socket: zmq.Socket[bytes], message: bytes, deadline: float) -> bool:
        wait = _FIRST_WAIT
        tracker: zmq.MessageTracker | None = None
        while True:
            if tracker is None:
                # Again: no connected peer yet, or its queue is full.
                with contextlib.suppress(zmq.Again):
                    tracker = socket.send(message, zmq.NOBLOCK, copy=False, track=True)
            if tracker is not None and tracker.done:
                return True
            now = trio.current_time()
            if now >= deadline:
                return False
            await trio.sleep(min(wait, deadline - now))
            wait = min(wait * 2, _LONGEST_WAIT)

    def _socket_for(self, endpoint: Endpoint) -> _Socket:
        entry = self._sockets.get(endpoint)
        if entry is not None:
            self._sockets.move_to_end(endpoint)
            return entry
        if len(self._sockets) >= self.max_sockets:
            idle = next((e for e in self._sockets.values() if e.users == 0), None)
            if idle is None:
                raise CompletionFailed(
                    f"{self.max_sockets} prefill endpoints are being sent to at once; "
                    f"no room for {endpoint.address}"
                )
            self._close(idle)
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.LINGER, 0)
        if endpoint.address.startswith("tcp://["):
            socket.setsockopt(zmq.IPV6, 1)
        try:
            socket.connect(endpoint.address)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise CompletionFailed(f"cannot connect to {endpoint.address}: {exc}") from None
        entry = _Socket(endpoint, socket, last_used=trio.current_time())
        self._sockets[endpoint] = entry
        return entry

    def _close(self, entry: _Socket) -> None:
        if self._sockets.get(entry.endpoint) is entry:
            del self._sockets[entry.endpoint]
        entry.socket.close(linger=0)

    def close_idle(self) -> None:
        """Close every socket unused for :data:`IDLE_SECONDS`."""
        now = trio.current_time()
        for entry in list(self._sockets.values()):
            if entry.users == 0 and now - entry.last_used >= IDLE_SECONDS:
                self._close(entry)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Close idle sockets until cancelled; then close them all and the context."""
        task_status.started()
        try:
            while True:
                await trio.sleep(IDLE_SECONDS / 2)
                self.close_idle()
        finally:
            for entry in list(self._sockets.values()):
                self._close(entry)
            self._context.term()


# -- failure notices: error pushes, bounded per client --------------------------------------

PUSHES_PER_CLIENT = 16
"""Error pushes one client's notices may have in flight: a batch, well under the pusher's share
of sockets for errors (64 of 256), so one client cannot hold all of them."""
QUEUED_PER_CLIENT = 4096
"""Error pushes one client's notices may have waiting (64 failed requests naming the most
endpoints one may name)."""
QUEUED = 16_384
"""Error pushes waiting, all clients together (a few bytes each)."""
QUEUED_SECONDS = 60.0
"""A push that waited this long is dropped: its rank has timed the request out by then."""


@dataclass(eq=False)
class _Notice:
    """One failure, told to the endpoints given with it."""

    req_id: str
    message: bytes
    endpoints: int
    at: float
    left: int = 0
    failed: int = 0
    dropped: int = 0


@dataclass(eq=False)
class _Queue:
    """One client's pushes: those in flight and those waiting their turn."""

    waiting: deque[tuple[_Notice, Endpoint]] = field(default_factory=deque)
    in_flight: int = 0


class FailureNotices:
    """A request's failure pushed to the prefill ranks bound to it, in the background, bounded
    per client and in all: a failure is best effort and may name endpoints nobody listens on
    (each then costs its push the whole timeout), so it is kept off every path that matters.

    - Each client (by address: whoever named the endpoints, or whose ``/send`` failed) has at
      most :data:`PUSHES_PER_CLIENT` error pushes in flight; the rest wait in its own queue, in
      order, so its dead endpoints delay only its own notices.
    - At most :data:`QUEUED_PER_CLIENT` pushes wait per client and :data:`QUEUED` in all; a
      push beyond them, or one that waited :data:`QUEUED_SECONDS` (its rank has given up by
      then), is dropped and counted as failed.
    - The pusher lets error pushes hold only a share of its sockets, so done pushes (a
      ``/send`` waiting for its rank's message) always find one.
    - A notice is one log line when its last push ended (how many endpoints, how many failed
      or were dropped), never one per push.
    - Every push runs contained (:class:`~trio_encode.observer.TaskFaults`): an exception from
      it is logged, counted, and ends only that push.

    The service calls :meth:`notify` (synchronous, never waits) and runs :meth:`run` in its
    nursery.
    """

    def __init__(
        self,
        pusher: Pusher,
        faults: TaskFaults,
        *,
        observer: LifecycleObserver | None = None,
        per_client: int = PUSHES_PER_CLIENT,
        queued_per_client: int = QUEUED_PER_CLIENT,
        queued: int = QUEUED,
    ) -> None:
        if min(per_client, queued_per_client, queued) < 1:
            raise ValueError("notice bounds must be at least 1")
        self._pusher = pusher
        self._faults = faults
        self._observer: LifecycleObserver = observer or NullObserver()
        self.per_client = per_client
        self.queued_per_client = queued_per_client
        self.queued = queued
        self._queues: dict[str, _Queue] = {}
        self._waiting = 0
        self._nursery: trio.Nursery | None = None

    @property
    def pending(self) -> int:
        """Pushes in flight or waiting, all clients together."""
        return self._waiting + sum(q.in_flight for q in self._queues.values())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery the pushes run in, until cancelled (what is pending is dropped)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def notify(self, req_id: str, message: bytes, endpoints: Mapping[Endpoint, str]) -> None:
        """Push ``message`` (``req_id``'s failure) to each endpoint, charged to the client it
        maps to. Returns at once; pushes beyond the bounds are dropped and counted."""
        if not endpoints:
            return
        notice = _Notice(req_id, message, len(endpoints), trio.current_time())
        for endpoint, client in endpoints.items():
            queue = self._queues.get(client)
            if queue is None:
                queue = self._queues[client] = _Queue()
            must_wait = queue.in_flight >= self.per_client
            if self._nursery is None or (
                must_wait
                and (self._waiting >= self.queued or len(queue.waiting) >= self.queued_per_client)
            ):
                notice.dropped += 1
                self._observer.completion_pushed("error", ok=False)
                continue
            notice.left += 1
            queue.waiting.append((notice, endpoint))
            self._waiting += 1
            self._pump(client)
        if not notice.left:
            self._summarize(notice)
        for client in endpoints.values():
            self._drop_if_idle(client)

    def _pump(self, client: str) -> None:
        """Start the client's waiting pushes while it has room in flight (none once the
        nursery is going away: what waits is dropped with it)."""
        queue = self._queues[client]
        now = trio.current_time()
        while (
            queue.waiting
            and queue.in_flight < self.per_client
            and self._nursery is not None
            and not self._nursery.cancel_scope.cancel_called
        ):
            notice, endpoint = queue.waiting.popleft()
            self._waiting -= 1
            if now - notice.at > QUEUED_SECONDS:
                notice.dropped += 1
                self._observer.completion_pushed("error", ok=False)
                self._one_ended(notice)
                continue
            queue.in_flight += 1
            self._nursery.start_soon(
                self._faults.contain, "failure_notice", self._deliver, client, notice, endpoint
            )

    async def _deliver(self, client: str, notice: _Notice, endpoint: Endpoint) -> None:
        ok = False
        try:
            await self._pusher.push(endpoint, notice.message, kind="error")
            ok = True
        except CompletionFailed:
            pass  # counted by the pusher; summed up in the notice's one line
        finally:
            if not ok:
                notice.failed += 1
            queue = self._queues[client]
            queue.in_flight -= 1
            self._one_ended(notice)
            self._pump(client)
            self._drop_if_idle(client)

    def _one_ended(self, notice: _Notice) -> None:
        notice.left -= 1
        if not notice.left:
            self._summarize(notice)

    def _drop_if_idle(self, client: str) -> None:
        queue = self._queues.get(client)
        if queue is not None and not queue.waiting and not queue.in_flight:
            del self._queues[client]

    @staticmethod
    def _summarize(notice: _Notice) -> None:
        """The notice's one log line, once its last push ended."""
        told = notice.endpoints - notice.failed - notice.dropped
        level = logging.INFO if told == notice.endpoints else logging.WARNING
        log.log(
            level,
            "failure told to %d of %d prefill endpoints (%d failed, %d dropped)",
            told,
            notice.endpoints,
            notice.failed,
            notice.dropped,
            extra={"req_id": notice.req_id},
        )
