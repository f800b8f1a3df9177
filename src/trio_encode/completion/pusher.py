"""Pushes completion messages to prefill ranks over ZMQ without blocking the event loop.

One PUSH socket per endpoint (``tcp://host:port``), reused by every message to it, closed
after :data:`IDLE_SECONDS` unused; at most :data:`MAX_SOCKETS` are open (a new endpoint closes
the least recently used idle one first). Every socket queues at most :data:`SEND_HWM` messages,
queues only to a connected peer (``ZMQ_IMMEDIATE``, so a gone host fails the push instead of
holding it) and drops what is left when it closes (linger 0).

A push never blocks: it offers the message without waiting and, while the socket cannot take
it or has not yet written it out, sleeps a little (1 ms, doubling up to 20 ms) until the
push's timeout. It counts as sent once ZMQ has written it to the connection (its tracker is
done), so closing the socket later cannot drop it. A host that is gone costs that one message
its timeout, and no thread, lock or other endpoint's message.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import trio
import zmq

from trio_encode.errors import CompletionFailed
from trio_encode.observer import LifecycleObserver, NullObserver

log = logging.getLogger(__name__)

IDLE_SECONDS = 10.0
"""An endpoint's socket unused this long is closed."""
MAX_SOCKETS = 256
"""Sockets open at once; beyond it the least recently used idle one is closed."""
SEND_HWM = 64
"""Messages one socket queues before a push to it has to wait."""
_FIRST_WAIT, _LONGEST_WAIT = 0.001, 0.02

_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


@dataclass(frozen=True)
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


class CompletionPusher:
    """The PUSH sockets of one server; :meth:`run` in the service nursery closes idle ones
    and, on exit, all of them."""

    def __init__(self, *, timeout: float, observer: LifecycleObserver | None = None) -> None:
        if not timeout > 0:
            raise ValueError("the push timeout must be positive")
        self.timeout = timeout
        self._observer: LifecycleObserver = observer or NullObserver()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self._sockets: OrderedDict[Endpoint, _Socket] = OrderedDict()
        self.sent = 0
        self.failed = 0

    @property
    def open_sockets(self) -> int:
        return len(self._sockets)

    async def push(self, endpoint: Endpoint, message: bytes, *, kind: str) -> None:
        """Deliver ``message`` to ``endpoint`` within the timeout, or raise
        :class:`CompletionFailed` saying why. ``kind`` labels the count (done, error)."""
        try:
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
        if len(self._sockets) >= MAX_SOCKETS:
            idle = next((e for e in self._sockets.values() if e.users == 0), None)
            if idle is None:
                raise CompletionFailed(
                    f"{MAX_SOCKETS} prefill endpoints are being sent to at once; "
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
