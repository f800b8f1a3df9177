"""The HTTP listener: hypercorn's per-connection server, each connection's failures contained.

Hypercorn's Trio worker runs every connection's tasks in one nursery with its listeners, so an
exception that escapes one connection ends them all, and the process with them. Such
exceptions happen: with a handler that awaits before answering, a request whose body is cut
short and then half-closed makes hypercorn send on one stream from two tasks
(``trio.BusyResourceError``), which escapes its connection task; an h11 error at the socket
layer does the same. This module owns the accept loop instead, and runs hypercorn's
:class:`~hypercorn.trio.tcp_server.TCPServer` for each connection inside a handler that catches
whatever that one connection raises: the connection is closed, the failure logged once with
its kind and counted, and every other connection and request goes on. Two causes are also
removed at their root (:class:`_GuardedStream`, :class:`_Connection`): the racing half-close,
and the closes and keep-alive timers that quart-trio's cancellation cut short, which left
answered connections open for as long as their clients liked (the timer is now one task per
connection, not one per call).

Everything else is hypercorn's own: the ASGI lifespan, the protocol, timeouts, keep-alive, and
the graceful close (idle connections close at once, busy ones get ``graceful_timeout``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState, LifespanState
from hypercorn.utils import repr_socket_addr

log = logging.getLogger(__name__)

ConnectionFailed = Callable[[str], int]
"""Told the kind (the exceptions' class names) of each connection that failed; returns how
many connections have failed with that kind so far (the first one's trace is logged)."""


async def serve_connections(
    app: AppWrapper,
    config: Config,
    sockets: Sockets,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]],
    connection_failed: ConnectionFailed,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``sockets`` (bound and listening; plain TCP) until
    ``shutdown_trigger`` returns, then close gracefully. Started with ``nursery.start``, gives
    the ``http://host:port`` of each socket once the app's lifespan has started."""
    if sockets.secure_sockets or sockets.quic_sockets:
        raise ValueError("only plain TCP sockets are served")
    config.set_statsd_logger_class(StatsdLogger)
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(app, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        listeners = [
            trio.SocketListener(trio.socket.from_stdlib_socket(sock))
            for sock in sockets.insecure_sockets
        ]
        binds = [
            f"http://{repr_socket_addr(sock.family, sock.getsockname())}"
            for sock in sockets.insecure_sockets
        ]
        handler = partial(
            _serve_one, app, config, context, lifespan_state, connection_failed=connection_failed
        )
        async with trio.open_nursery() as connections:
            try:
                async with trio.open_nursery() as accepting:
                    accepting.start_soon(
                        partial(trio.serve_listeners, handler_nursery=connections),
                        handler,
                        listeners,
                    )
                    task_status.started(binds)
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()
            finally:
                for listener in listeners:  # no new connections during the grace
                    await trio.aclose_forcefully(listener)
                # Hypercorn's close: idle keep-alive connections end now, busy ones finish
                # their answer (and are told to close) within the grace.
                await context.terminated.set()
                connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _serve_one(
    app: AppWrapper,
    config: Config,
    context: WorkerContext,
    lifespan_state: LifespanState,
    stream: trio.SocketStream,
    *,
    connection_failed: ConnectionFailed,
) -> None:
    guarded = _GuardedStream(stream)
    state = ConnectionState(lifespan_state.copy())
    try:
        await _Connection(app, config, context, state, guarded)
    except* Exception as group:
        # One connection's failure: whatever hypercorn (or h11, or the socket) raised in its
        # tasks. Cancellation (shutdown) is not caught and propagates as it should.
        kind = ",".join(sorted({type(exc).__name__ for exc in _leaves(group)}))
        if connection_failed(kind) == 1:  # a client can repeat it at will: its trace once
            log.warning("closed a connection whose server task failed: %s", kind, exc_info=group)
        else:
            log.debug("closed a connection whose server task failed: %s", kind)
        await trio.aclose_forcefully(stream)


class _Connection(TCPServer):
    """Hypercorn's per-connection server, with a keep-alive timer that costs no task per call.

    Hypercorn stops the connection's idle timer when a request arrives and starts a new one
    when its answer is out: a lock, a cancellation and a task start for every call, from the
    app's own task, which quart-trio cancels as soon as the answer is out (so the start was
    cut short, and an idle connection stayed open for as long as its client liked). Here the
    timer is one task for the connection's life (:class:`_IdleTimer`) whose deadline a call
    lifts and an answer sets again, with no checkpoint for a cancellation to cut."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.idle_task = _IdleTimer(self)  # type: ignore[assignment]

    async def _read_data(self) -> None:
        try:
            await super()._read_data()
        finally:
            # The client has closed (or the socket failed): the timer has nothing left to
            # time, and the connection's task group must not wait for it.
            self.idle_task.end()  # type: ignore[attr-defined]


class _IdleTimer:
    """Stands in for hypercorn's ``TrioSingleTask`` as the keep-alive timer of one connection.

    ``restart`` (the connection went idle) sets the deadline ``keep_alive_timeout`` ahead;
    ``stop`` (a request arrived) lifts it. Past the deadline, or when the server stops while
    the connection is idle, the connection is closed as hypercorn's own timer closes it. The
    first ``restart`` starts the task in the connection's task group, which ends with it."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self._scope = trio.CancelScope()
        self._started = False
        self._idle = False
        self._stopping = False
        """The server is shutting down: the connection closes as soon as it is idle."""
        self._ended = False

    async def restart(self, task_group: Any, action: object) -> None:
        self._idle = True
        self._scope.deadline = trio.current_time() + (
            0.0 if self._stopping else self._connection.config.keep_alive_timeout
        )
        if not self._started:
            self._started = True
            task_group._nursery.start_soon(self._run)

    async def stop(self) -> None:
        self._idle = False
        self._scope.deadline = math.inf

    def end(self) -> None:
        """The connection's reading has ended: stop timing without closing anything (what
        is still being answered is answered, then the connection closes as it ends)."""
        self._ended = True
        self._scope.cancel()

    async def _run(self) -> None:
        with self._scope:
            await self._connection.context.terminated.wait()
            self._stopping = True
            if not self._idle:
                await trio.sleep_forever()  # until the answer's ``restart``, due at once
        if self._ended:
            return
        with trio.CancelScope(shield=True):
            await self._connection._initiate_server_close()


class _GuardedStream(trio.abc.HalfCloseableStream):
    """A connection's socket as hypercorn's per-connection server uses it, with its send side
    made safe for the two ways hypercorn misuses it.

    Hypercorn half-closes (``send_eof``) from whichever task notices the end, while another
    task may be sending an answer: trio refuses the second sender (``BusyResourceError``).
    Here an EOF while a send runs is skipped (the close follows), and a send after the EOF
    is refused as a closed stream, which hypercorn expects. And the task that closes is often
    the app's own, which quart-trio cancels as soon as hypercorn tells it the client is gone:
    the close would stop at its first checkpoint and leave the socket open for as long as the
    client keeps it (answered connections were never closed). The half-close and the close
    are shielded: neither waits on the network."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self.socket = stream.socket
        """What hypercorn reads the peer's and its own address from."""
        self._sending = False
        self._eof_sent = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof_sent:
            raise trio.ClosedResourceError("this connection's send side is closed")
        self._sending = True
        try:
            await self._stream.send_all(data)
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        if self._sending or self._eof_sent:
            return
        self._eof_sent = True
        with trio.CancelScope(shield=True):
            await self._stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._stream.aclose()


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return leaves
