"""The ZMQ pushes of completion messages: delivered, reused, bounded, never blocking."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import trio
import zmq

from trio_encode.completion import CompletionPusher, Endpoint, Kind
from trio_encode.completion import pusher as pusher_module
from trio_encode.completion.pusher import MAX_SOCKETS
from trio_encode.errors import CompletionFailed


@pytest.fixture
def pull() -> Iterator[tuple[zmq.Socket[bytes], Endpoint]]:
    """A prefill rank's PULL socket on loopback, as SGLang binds one per request."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, Endpoint("127.0.0.1", port)
    sock.close(linger=0)
    context.term()


def dead_port() -> int:
    """A loopback port nobody listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def received(sock: zmq.Socket[bytes]) -> bytes:
    with trio.fail_after(5):
        while True:
            try:
                return sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                await trio.sleep(0.005)


async def test_messages_arrive_in_order_over_one_reused_socket(
    pull: tuple[zmq.Socket[bytes], Endpoint],
) -> None:
    sock, endpoint = pull
    async with trio.open_nursery() as nursery:
        pusher = CompletionPusher(timeout=5)
        await nursery.start(pusher.run)
        await pusher.push(endpoint, b"first", kind="done")
        await pusher.push(endpoint, b"second", kind="done")
        assert pusher.open_sockets == 1
        assert [await received(sock), await received(sock)] == [b"first", b"second"]
        assert (pusher.sent, pusher.failed) == (2, 0)
        nursery.cancel_scope.cancel()
    assert pusher.open_sockets == 0


async def test_a_gone_host_costs_only_its_own_message(
    pull: tuple[zmq.Socket[bytes], Endpoint],
) -> None:
    """A push to nobody fails at its timeout, while a push to a live rank started after it
    is delivered at once and the event loop keeps running."""
    sock, live = pull
    gone = Endpoint("127.0.0.1", dead_port())
    async with trio.open_nursery() as nursery:
        pusher = CompletionPusher(timeout=0.5)
        await nursery.start(pusher.run)
        failed_at: list[float] = []

        async def push_to_gone() -> None:
            with pytest.raises(CompletionFailed, match=r"within 0\.5 s"):
                await pusher.push(gone, b"lost", kind="done")
            failed_at.append(trio.current_time())

        started = trio.current_time()
        nursery.start_soon(push_to_gone)
        await trio.sleep(0.01)
        await pusher.push(live, b"kept", kind="done")
        assert await received(sock) == b"kept"
        assert trio.current_time() - started < 0.3  # not held behind the gone host
        ticks = 0
        while not failed_at:  # the loop stays free while the gone push waits
            ticks += 1
            await trio.sleep(0.01)
        assert ticks > 10
        assert 0.45 < failed_at[0] - started < 1.5
        assert (pusher.sent, pusher.failed) == (1, 1)
        assert pusher.open_sockets == 1  # the failed endpoint's socket was closed
        nursery.cancel_scope.cancel()


async def test_idle_sockets_are_closed_and_the_count_is_bounded(
    pull: tuple[zmq.Socket[bytes], Endpoint],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sock, endpoint = pull
    monkeypatch.setattr(pusher_module, "IDLE_SECONDS", 0.2)
    async with trio.open_nursery() as nursery:
        pusher = CompletionPusher(timeout=0.3, max_sockets=1)
        await nursery.start(pusher.run)
        await pusher.push(endpoint, b"one", kind="done")
        assert pusher.open_sockets == 1
        # A second endpoint closes the idle first one rather than going past the bound.
        with pytest.raises(CompletionFailed):
            await pusher.push(Endpoint("127.0.0.1", dead_port()), b"x", kind="error")
        assert pusher.open_sockets <= 1
        await pusher.push(endpoint, b"two", kind="done")
        assert [await received(sock), await received(sock)] == [b"one", b"two"]
        await trio.sleep(0.5)
        assert pusher.open_sockets == 0  # idle ones closed
        nursery.cancel_scope.cancel()


@pytest.fixture
def pulls() -> Iterator[list[tuple[zmq.Socket[bytes], Endpoint]]]:
    """Three prefill ranks' PULL sockets on loopback."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks = [context.socket(zmq.PULL) for _ in range(3)]
    yield [(s, Endpoint("127.0.0.1", s.bind_to_random_port("tcp://127.0.0.1"))) for s in socks]
    for s in socks:
        s.close(linger=0)
    context.term()


async def test_the_socket_bound_is_exact_and_closes_the_least_recently_used_idle_one(
    pulls: list[tuple[zmq.Socket[bytes], Endpoint]],
) -> None:
    """With the bound at 2 and three live ranks, two sockets are open: a new endpoint closes
    the idle one used longest ago, and every message still arrives."""
    (sock_a, a), (sock_b, b), (sock_c, c) = pulls
    async with trio.open_nursery() as nursery:
        pusher = CompletionPusher(timeout=5, max_sockets=2)
        await nursery.start(pusher.run)
        await pusher.push(a, b"a1", kind="done")
        await pusher.push(b, b"b1", kind="done")
        assert pusher.open_endpoints == [a, b]
        await pusher.push(a, b"a2", kind="done")  # a is now the most recently used
        await pusher.push(c, b"c1", kind="done")
        assert pusher.open_endpoints == [a, c]  # b, idle the longest, was closed
        await pusher.push(b, b"b2", kind="error")
        assert pusher.open_endpoints == [c, b]
        assert pusher.open_sockets == 2
        for sock, expected in ((sock_a, [b"a1", b"a2"]), (sock_b, [b"b1", b"b2"])):
            assert [await received(sock), await received(sock)] == expected
        assert await received(sock_c) == b"c1"
        assert (pusher.sent, pusher.failed) == (5, 0)
        nursery.cancel_scope.cancel()


async def test_a_full_bound_refuses_a_new_endpoint_rather_than_exceeding_it(
    pulls: list[tuple[zmq.Socket[bytes], Endpoint]],
) -> None:
    """Both sockets busy (pushes to gone hosts waiting): a third endpoint gets no socket and
    its push fails at once; the bound is never passed."""
    (_, live), *_ = pulls
    gone = [Endpoint("127.0.0.1", dead_port()) for _ in range(2)]
    async with trio.open_nursery() as nursery:
        pusher = CompletionPusher(timeout=0.5, max_sockets=2, error_sockets=2)
        await nursery.start(pusher.run)
        async with trio.open_nursery() as pushes:
            for endpoint in gone:
                pushes.start_soon(_fails, pusher, endpoint, "error")
            await trio.sleep(0.05)
            assert pusher.open_sockets == 2
            with pytest.raises(CompletionFailed, match="2 prefill endpoints are being sent to"):
                await pusher.push(live, b"x", kind="done")
            assert pusher.open_sockets == 2
        nursery.cancel_scope.cancel()


async def _fails(pusher: CompletionPusher, endpoint: Endpoint, kind: Kind) -> None:
    with pytest.raises(CompletionFailed):
        await pusher.push(endpoint, b"lost", kind=kind)


async def test_error_pushes_to_gone_hosts_never_take_the_sockets_done_pushes_need(
    pull: tuple[zmq.Socket[bytes], Endpoint],
) -> None:
    """300 error pushes to closed ports at once (one request naming them, as measured against
    a server that then answered a real rank's /send 502): they hold at most a quarter of the
    sockets, waiting their turn, while a rank's done push is delivered at once."""
    sock, live = pull
    gone = sorted({dead_port() for _ in range(300)})
    async with trio.open_nursery() as nursery:
        pusher = CompletionPusher(timeout=0.5)
        await nursery.start(pusher.run)
        async with trio.open_nursery() as pushes:
            for port in gone:
                pushes.start_soon(_fails, pusher, Endpoint("127.0.0.1", port), "error")
            await trio.sleep(0.1)
            started = trio.current_time()
            await pusher.push(live, b"done", kind="done")
            assert await received(sock) == b"done"
            assert trio.current_time() - started < 0.3
            # Meanwhile the error pushes still wait, on a quarter of the sockets.
            assert pusher.error_pushes == MAX_SOCKETS // 4
            assert pusher.open_sockets <= MAX_SOCKETS // 4 + 1
        nursery.cancel_scope.cancel()
    assert (pusher.sent, pusher.failed) == (1, len(gone))


def test_endpoints_are_host_names_or_addresses_and_ports() -> None:
    assert Endpoint("10.0.0.5", 30001).address == "tcp://10.0.0.5:30001"
    assert Endpoint("::1", 5).address == "tcp://[::1]:5"
    assert Endpoint("prefill-0.example", 1).address == "tcp://prefill-0.example:1"
    for host, port in (("10.0.0.5", 0), ("10.0.0.5", 70000), ("a b", 1), ("x;y", 1), ("", 1)):
        with pytest.raises(ValueError, match=r"embedding_port|prefill_host"):
            Endpoint(host, port)


def test_the_bounds_are_checked() -> None:
    for bounds in (
        {"max_sockets": 0},
        {"max_sockets": 4, "error_sockets": 5},
        {"error_sockets": 0},
    ):
        with pytest.raises(ValueError, match="sockets"):
            CompletionPusher(timeout=1, **bounds)
