"""The ZMQ pushes of completion messages: delivered, reused, bounded, never blocking."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import trio
import zmq

from trio_encode.completion import CompletionPusher, Endpoint
from trio_encode.completion import pusher as pusher_module
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
    monkeypatch.setattr(pusher_module, "MAX_SOCKETS", 1)
    async with trio.open_nursery() as nursery:
        pusher = CompletionPusher(timeout=0.3)
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


def test_endpoints_are_host_names_or_addresses_and_ports() -> None:
    assert Endpoint("10.0.0.5", 30001).address == "tcp://10.0.0.5:30001"
    assert Endpoint("::1", 5).address == "tcp://[::1]:5"
    assert Endpoint("prefill-0.example", 1).address == "tcp://prefill-0.example:1"
    for host, port in (("10.0.0.5", 0), ("10.0.0.5", 70000), ("a b", 1), ("x;y", 1), ("", 1)):
        with pytest.raises(ValueError, match=r"embedding_port|prefill_host"):
            Endpoint(host, port)
