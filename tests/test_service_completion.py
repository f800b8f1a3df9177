"""Completion and failure pushes from the service: who is told, how many endpoints a request
may bind, what one client's pushes may cost the others, and that no background task's fault
reaches the service nursery.

Mock-clock tests script the pusher (:class:`ScriptedPusher`); those about ZMQ itself use the
real :class:`CompletionPusher` on loopback (on the real clock when a peer must connect).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio
import trio.testing
import zmq

from support.lifecycle_rig import (
    Landing,
    RecordingObserver,
    SeededEncoder,
    landing_on,
    make_embedding,
)
from support.sglang_pickle import EmbeddingData, safe_loads
from test_completion_notices import ScriptedPusher
from trio_encode.completion import CompletionPusher, Endpoint, Pusher
from trio_encode.completion.pusher import MAX_SOCKETS
from trio_encode.embedding import Embedding
from trio_encode.errors import (
    CompletionFailed,
    EncodeFailed,
    InvalidInput,
    ReceiveCountConflict,
    RequestError,
    RequestReleased,
    ScopeExpired,
    UnknownRequest,
)
from trio_encode.service import MAX_ENDPOINTS, EncodeService, Notify, Part, ServiceSettings
from trio_encode.testing.memory_engine import InMemoryEngine, InMemoryFabric

HOST = "127.0.0.1"


class Encoder(SeededEncoder):
    """``img:`` items encode in ``latency`` s; ``fail:`` ones raise in the encoder, ``bad:``
    ones are found undecodable while encoding, ``slow:`` ones take 1000 s; more than four
    items pass a limit (checked when loading, before any scope)."""

    def __init__(self, latency: float = 1.0) -> None:
        self.latency = latency

    async def load_items(self, items: Sequence[str], modality: str = "IMAGE") -> list[bytes]:
        if len(items) > 4:
            raise InvalidInput(f"{len(items)} items, more than the 4 this server queues")
        if any(not item.startswith(("img:", "fail:", "bad:", "slow:")) for item in items):
            raise InvalidInput("not an image")
        return [item.encode() for item in items]

    async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> Embedding:
        slow = any(image.startswith(b"slow:") for image in images)
        await trio.sleep(1000.0 if slow else self.latency)
        if any(image.startswith(b"fail:") for image in images):
            raise RuntimeError("the vision tower raised")
        if any(image.startswith(b"bad:") for image in images):
            raise InvalidInput("mm_items[0]: cannot decode the image")
        return make_embedding(len(b"".join(images)))


@dataclass
class World:
    service: EncodeService
    sender: InMemoryEngine
    ranks: list[Landing]
    observer: RecordingObserver
    fabric: InMemoryFabric


@asynccontextmanager
async def world(
    pusher: Pusher | None = None, *, latency: float = 1.0, **settings: Any
) -> AsyncIterator[World]:
    fabric = InMemoryFabric()
    sender = fabric.engine("encoder")
    ranks = []
    for i in range(4):
        ranks.append(await landing_on(fabric, f"rank{i}"))
    observer = RecordingObserver()
    with trio.fail_after(3600):
        async with EncodeService.running(
            engine=sender,
            encoder=Encoder(latency),
            settings=ServiceSettings(**settings),
            observer=observer,
            pusher=pusher,
        ) as service:
            yield World(service, sender, ranks, observer, fabric)


def ports(count: int, first: int = 40000) -> list[Endpoint]:
    return [Endpoint(HOST, port) for port in range(first, first + count)]


def loaded(message: bytes) -> EmbeddingData:
    return safe_loads(message)  # type: ignore[no-any-return]


async def outcome(call: Any) -> object:
    try:
        return await call
    except RequestError as exc:
        return exc


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


# -- how many endpoints a request may bind ---------------------------------------------------


async def test_an_encode_naming_more_endpoints_than_the_cap_is_refused_and_leaves_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pusher = ScriptedPusher()
    async with world(pusher) as w:
        with pytest.raises(InvalidInput, match=f"65 prefill endpoints.*at most {MAX_ENDPOINTS}"):
            await w.service.encode(
                "r1", ["fail:x"], receive_count=None, part=Part(endpoints=tuple(ports(65)))
            )
        await settle()
        assert len(w.service.registry) == 0
        assert pusher.delivered == []
        # Nothing remembered: the same id, corrected, is served.
        report = await w.service.encode(
            "r1", ["img:x"], receive_count=1, part=Part(endpoints=tuple(ports(MAX_ENDPOINTS)))
        )
        assert report.shape.rows > 0


async def test_joins_cannot_bind_more_endpoints_than_the_cap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Siblings' /encode calls add endpoints up to the cap; one that would pass it is refused
    (400) and changes nothing, not even the count it names; when the request fails, each
    bound endpoint (and no other) is told once."""
    pusher = ScriptedPusher()
    first, more, extra = ports(40), ports(24, first=41000), ports(1, first=42000)
    async with world(pusher) as w:

        async def encode(endpoints: list[Endpoint], count: int | None = None) -> object:
            part = Part(endpoints=tuple(endpoints))
            return await outcome(
                w.service.encode("r1", ["fail:x"], receive_count=count, part=part, client="c")
            )

        accepted: list[object] = []

        async def join(endpoints: list[Endpoint]) -> None:
            accepted.append(await encode(endpoints))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(join, first)
            await settle()
            refused = await encode(first[:10] + more + extra, count=2)  # 40 + 25 new
            assert isinstance(refused, InvalidInput)
            assert "65 prefill endpoints" in refused.message
            assert w.service.registry.require_live("r1").receive_count is None
            nursery.start_soon(join, first + more)  # 64 exactly
            nursery.start_soon(join, first[:5])  # nothing new
            await settle()
            assert isinstance(await encode(extra), InvalidInput)  # the 65th, alone
        assert [type(a) for a in accepted] == [EncodeFailed] * 3
        await settle()
    told = {endpoint for endpoint, _, kind, _ in pusher.delivered if kind == "error"}
    assert told == set(first + more)
    assert len(pusher.delivered) == MAX_ENDPOINTS


# -- sibling parts: work in proportion to those that exist -----------------------------------


async def test_a_failed_part_claiming_millions_of_parts_ends_only_the_siblings_that_exist(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Part 0 of a request claiming 5,000,000 parts fails: its two live siblings and the
    pulls waiting for two more are ended at once, and the failure costs the parts that exist
    here (milliseconds), not the number claimed (seconds of a blocked event loop)."""
    claimed = 5_000_000

    def part_id(index: int) -> str:
        return f"rid_local_part_{index}"

    async with world(ScriptedPusher()) as w:
        outcomes: dict[str, object] = {}

        async def encode(index: int, item: str) -> None:
            part = Part(claimed, index)
            call = w.service.encode(part_id(index), [item], receive_count=None, part=part)
            outcomes[part_id(index)] = await outcome(call)

        async def pull(index: int) -> None:
            outcomes[f"pull {index}"] = await outcome(w.service.pull(part_id(index)))

        async with trio.open_nursery() as nursery:
            for index in (1, 2):
                nursery.start_soon(encode, index, "slow:x")
            for index in (3, claimed - 1):
                nursery.start_soon(pull, index)
            await settle()
            started = time.perf_counter()
            await encode(0, "fail:x")
            await settle()
            elapsed = time.perf_counter() - started
        assert elapsed < 0.5, elapsed
        assert trio.current_time() < 10  # nobody waited for a timeout
        assert isinstance(outcomes[part_id(0)], EncodeFailed)
        for key in (part_id(1), part_id(2), "pull 3", f"pull {claimed - 1}"):
            error = outcomes[key]
            assert isinstance(error, EncodeFailed), (key, error)
            assert error.message.startswith("part 0 of this request failed"), key
        await settle()
        assert len(w.service.registry) == 0
        assert len(w.service.arrivals) == 0


# -- who may be told: held requests, bound endpoints -----------------------------------------


async def test_failure_pushes_go_only_to_endpoints_of_requests_this_server_holds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A /send for an id never held here pushes nothing (even naming a part no message can
    carry); one for a held request pushes its error only to an endpoint the request bound,
    and each endpoint hears of the failure once."""
    pusher = ScriptedPusher()
    named, stranger = Endpoint(HOST, 5000), Endpoint("203.0.113.9", 5001)
    async with world(pusher) as w:
        receiver = w.ranks[0].receiver
        for part_idx in (0, 10**80):
            with pytest.raises(UnknownRequest):
                await w.service.send("ghost", receiver, notify=Notify(stranger, part_idx))
        await w.service.encode("r1", ["img:a"], receive_count=2, part=Part(endpoints=(named,)))
        for endpoint in (stranger, named, named):
            with pytest.raises(ReceiveCountConflict):
                await w.service.send("r1", receiver, receive_count=3, notify=Notify(endpoint))
        await settle()
        assert pusher.to(stranger) == []
        (message,) = pusher.to(named)
        assert loaded(message).error_code == 409
        assert w.service.faults.counts == {}


# -- containment -----------------------------------------------------------------------------


async def test_a_fault_in_a_background_task_is_contained_and_the_service_goes_on(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pusher whose error push raises a bug, and a watcher whose failure handling raises:
    each is logged and counted by kind; the request still ends and gives its memory back, and
    other requests are encoded, sent and told of their completion."""
    pusher = ScriptedPusher()
    broken, rank = Endpoint(HOST, 6000), Endpoint(HOST, 6001)
    pusher.broken.add(broken)
    async with world(pusher) as w:
        with pytest.raises(EncodeFailed):
            await w.service.encode(
                "r1", ["fail:x"], receive_count=1, part=Part(endpoints=(broken,))
            )
        await settle()
        assert w.service.faults.counts == {"failure_notice": 1}

        def bug(*args: object) -> None:
            raise KeyError("a bug in the failure path")

        monkeypatch.setattr(w.service, "_failed", bug)
        with pytest.raises(EncodeFailed):
            await w.service.encode("r2", ["fail:y"], receive_count=1)
        await settle()
        assert w.service.faults.counts == {"failure_notice": 1, "failure": 1}
        assert len(w.service.registry) == 0
        assert w.service.held_bytes == 0

        await w.service.encode("r3", ["img:a"], receive_count=1)
        report = await w.service.send("r3", w.ranks[0].receiver, notify=Notify(rank))
        assert report.receivers_done == 1
        (done,) = pusher.to(rank, "done")
        assert loaded(done).shape == [report.shape.rows, report.shape.dim]


# -- what each rank is told ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["bad:x"], "mm_items[0]: cannot decode the image"),
        (["img:a"] * 5, "5 items, more than the 4 this server queues"),
    ],
    ids=["undecodable", "a limit"],
)
async def test_a_refused_encode_tells_each_named_endpoint_400_and_its_message(
    autojump_clock: trio.testing.MockClock, items: list[str], message: str
) -> None:
    pusher = ScriptedPusher()
    named = ports(3)
    async with world(pusher) as w:
        part = Part(2, 1, tuple(named))
        with pytest.raises(InvalidInput, match=re.escape(message)):
            await w.service.encode("rid_local_part_1", items, receive_count=None, part=part)
        await settle()
    for endpoint in named:
        (raw,) = pusher.to(endpoint, "error")
        data = loaded(raw)
        assert (data.req_id, data.num_parts, data.part_idx) == ("rid_local_part_1", 2, 1)
        assert (data.error_code, data.error_msg) == (400, message)
        assert data.shape is None
    assert len(pusher.delivered) == len(named)


async def test_a_send_on_an_expired_request_tells_its_own_endpoint_504(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The backstop fires while rank 0's transfer is stuck (its peer frozen): its /send gets
    504 and its endpoint the 504; the other rank the /encode named, which never sent, hears
    nothing."""
    pusher = ScriptedPusher()
    mine, other = Endpoint(HOST, 7000), Endpoint(HOST, 7001)
    async with world(pusher, send_timeout=20.0) as w:
        part = Part(endpoints=(mine, other))
        await w.service.encode("r1", ["img:a"], receive_count=2, part=part)
        w.fabric.freeze(w.ranks[0].engine.session_id)  # transfers hang for 30 s
        with pytest.raises(ScopeExpired):
            await w.service.send("r1", w.ranks[0].receiver, notify=Notify(mine))
        await settle()
    (raw,) = pusher.to(mine)
    assert loaded(raw).error_code == 504
    assert pusher.to(other) == []


async def test_a_send_on_a_released_request_tells_its_own_endpoint_410(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pusher = ScriptedPusher()
    first, late = Endpoint(HOST, 7000), Endpoint(HOST, 7001)
    async with world(pusher) as w:
        await w.service.encode("r1", ["img:a"], receive_count=1, part=Part(endpoints=(first, late)))
        await w.service.send("r1", w.ranks[0].receiver, notify=Notify(first))
        await settle()
        with pytest.raises(RequestReleased):
            await w.service.send("r1", w.ranks[1].receiver, notify=Notify(late))
        await settle()
    (raw,) = pusher.to(late)
    assert loaded(raw).error_code == 410
    assert [loaded(m).error_code for m in pusher.to(first)] == [None]  # its done message only


# -- over real ZMQ ---------------------------------------------------------------------------


@pytest.fixture
def rank_socket() -> Iterator[tuple[zmq.Socket[bytes], Endpoint]]:
    """A prefill rank's PULL socket on loopback."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.PULL)
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    yield sock, Endpoint(HOST, port)
    sock.close(linger=0)
    context.term()


def dead_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


async def received(sock: zmq.Socket[bytes], within: float = 5.0) -> list[bytes]:
    """What reached ``sock`` within ``within`` seconds (at least one message)."""
    messages: list[bytes] = []
    with trio.move_on_after(within):
        while not messages:
            await trio.sleep(0.005)
            while True:
                try:
                    messages.append(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
    return messages


async def test_a_repeat_send_answers_repeat_and_pushes_no_second_message(
    rank_socket: tuple[zmq.Socket[bytes], Endpoint],
) -> None:
    """Rank 0 sends, then sends again with the same buffer before and after the request
    completes: each repeat is a 200 ``repeat: true`` and its rank gets one message in all."""
    sock, endpoint = rank_socket
    async with world(latency=0.0) as w:
        assert w.service.messages is not None
        pusher = w.service.messages.completions
        assert isinstance(pusher, CompletionPusher)
        await w.service.encode("r1", ["img:a"], receive_count=2)
        rank0, rank1 = w.ranks[0].receiver, w.ranks[1].receiver
        first = await w.service.send("r1", rank0, notify=Notify(endpoint))
        assert not first.repeat
        before = await w.service.send("r1", rank0, notify=Notify(endpoint))
        await w.service.send("r1", rank1)  # completes the request
        after = await w.service.send("r1", rank0, notify=Notify(endpoint))
        assert before.repeat
        assert after.repeat
        assert pusher.sent == 1
        assert len(await received(sock)) == 1
        await trio.sleep(0.2)
        assert len(await received(sock, within=0.1)) == 0
    assert w.observer.names("completion_pushed") == [("done", True)]


async def test_a_send_whose_rank_is_gone_is_a_502_naming_it_with_the_bytes_landed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gone = Endpoint(HOST, dead_port())
    async with world(completion_timeout=5.0) as w:
        assert w.service.messages is not None
        pusher = w.service.messages.completions
        assert isinstance(pusher, CompletionPusher)
        await w.service.encode("r1", ["img:a"], receive_count=1)
        with pytest.raises(CompletionFailed, match=f"{gone.address} within 5 s") as failed:
            await w.service.send("r1", w.ranks[0].receiver, notify=Notify(gone))
        assert failed.value.status == 502
        assert failed.value.req_id == "r1"
        expected = bytes(make_embedding(len(b"img:a")).tensor.numpy().tobytes())
        assert w.ranks[0].landed(len(expected)) == expected
        await settle()
        assert (pusher.sent, pusher.failed) == (0, 1)
    assert w.observer.names("completion_pushed") == [("done", False)]


async def test_a_ranks_done_push_succeeds_while_300_closed_ports_wait_for_failures(
    rank_socket: tuple[zmq.Socket[bytes], Endpoint],
) -> None:
    """Twenty clients' requests fail, naming 300 closed ports between them: their error
    pushes wait their turn for a quarter of the sockets, and a real rank's /send meanwhile
    gets its completion message and its 200 at once (before: all 256 sockets busy, 502)."""
    sock, live = rank_socket
    closed = sorted({dead_port() for _ in range(320)})[:300]
    assert len(closed) == 300
    async with world(latency=0.0, completion_timeout=2.0) as w:
        assert w.service.messages is not None
        pusher = w.service.messages.completions
        assert isinstance(pusher, CompletionPusher)
        for client in range(20):
            named = tuple(Endpoint(HOST, p) for p in closed[client * 15 : (client + 1) * 15])
            with pytest.raises(EncodeFailed):
                await w.service.encode(
                    f"f{client}",
                    ["fail:x"],
                    receive_count=1,
                    part=Part(endpoints=named),
                    client=f"10.0.0.{client}",
                )
        await trio.sleep(0.2)
        started = trio.current_time()
        await w.service.encode("live", ["img:a"], receive_count=1)
        report = await w.service.send("live", w.ranks[0].receiver, notify=Notify(live))
        assert trio.current_time() - started < 0.5
        assert report.receivers_done == 1
        (message,) = await received(sock)
        assert loaded(message).req_id == "live"
        # Meanwhile the failures still wait, holding no more than their share.
        assert pusher.error_pushes == MAX_SOCKETS // 4
        assert w.service.messages is not None
        notices = w.service.messages.notices
        assert notices.pending > 200
