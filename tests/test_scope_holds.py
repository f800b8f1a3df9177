"""What a request keeps alive, and what a late call is told, on the mock clock.

A request's image bytes are megabytes; anything that outlives its use (a closure, an exception
raised in many tasks) multiplies them by every request in flight. And a call that arrives
while a finished request is still releasing must get the answer the request's tombstone will
give, not a 200 for a scope it can no longer join.
"""

from __future__ import annotations

import gc
import traceback
import weakref
from collections.abc import Sequence

import pytest
import torch
import trio
import trio.testing

from support.lifecycle_rig import SeededEncoder, gather_sends, lifecycle_rig
from trio_encode.arrivals import Arrivals
from trio_encode.engine import TRANSFER_FAILED, EngineError
from trio_encode.errors import InvalidInput, RequestReleased, UnknownRequest
from trio_encode.request_types import Receiver
from trio_encode.service import EncodeService, ServiceSettings
from trio_encode.testing.memory_engine import InMemoryFabric


class Images(list[bytes]):
    """A request's loaded images, which a test can watch through a weakref."""


class WatchedEncoder(SeededEncoder):
    """An encoder whose loaded images can be watched; ``bad`` items are refused."""

    def __init__(self) -> None:
        self.loaded: list[weakref.ref[Images]] = []

    async def load_items(self, items: Sequence[str], modality: str = "IMAGE") -> list[bytes]:
        await trio.sleep(0.1)
        if "bad" in items:
            raise InvalidInput("mm_items[0]: not an image")
        images = Images(item.encode() for item in items)
        self.loaded.append(weakref.ref(images))
        return images


async def test_each_waiting_pull_raises_its_own_error() -> None:
    """Pulls waiting for an id that an /encode then names with bad input: each raises its own
    exception, none carrying the refused /encode's frames or another waiter's."""
    arrivals = Arrivals()
    caught: list[InvalidInput] = []

    async def pull() -> None:
        try:
            await arrivals.wait("r1")
        except InvalidInput as exc:
            caught.append(exc)

    def refuse_the_encode() -> InvalidInput:
        try:
            raise InvalidInput("mm_items[0]: not an image", req_id="r1")
        except InvalidInput as exc:
            return exc

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(pull)
        await trio.testing.wait_all_tasks_blocked()
        refused = refuse_the_encode()
        arrivals.announce("r1", error=refused)
    assert len(caught) == 3
    assert len({id(exc) for exc in [refused, *caught]}) == 4, "one object raised everywhere"
    for exc in caught:
        assert (exc.message, exc.req_id) == (refused.message, "r1")
        frames = [frame.name for frame in traceback.extract_tb(exc.__traceback__)]
        assert "refuse_the_encode" not in frames
        assert frames.count("wait") == 1, frames  # its own wait, not every waiter's


async def test_a_scope_drops_the_image_bytes_once_the_encode_is_done(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The scope lives on for its sends (up to its backstop), but its image bytes are needed
    only by the encode: they must go when it is done, not when the scope ends."""
    fabric = InMemoryFabric()
    encoder = WatchedEncoder()
    async with EncodeService.running(engine=fabric.engine("encoder"), encoder=encoder) as service:
        await service.encode("r1", ["img:a"], receive_count=2)
        assert service.registry.live("r1") is not None, "waiting for its two sends"
        gc.collect()
        assert encoder.loaded[0]() is None, "the scope still holds the request's images"
        service.registry.require_live("r1").cancel()


async def test_an_encode_arriving_while_a_completed_scope_releases_gets_410(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fabric = InMemoryFabric()
    sender = fabric.engine("encoder")
    async with EncodeService.running(engine=sender, encoder=WatchedEncoder()) as service:
        await service.encode("r1", ["img:a"], receive_count=1)
        rank = fabric.engine("rank0")
        buffer = torch.zeros(1 << 16, dtype=torch.uint8)
        await rank.register(int(buffer.data_ptr()), buffer.numel())
        gate = sender.gate("deregister")
        await service.send("r1", Receiver(rank.session_id, int(buffer.data_ptr())))
        await gate.wait_arrivals(1)  # complete, and releasing its registration
        try:
            assert service.registry.live("r1") is not None
            with pytest.raises(RequestReleased):
                await service.encode("r1", ["img:a"], receive_count=1)
            with pytest.raises(RequestReleased):
                await service.pull("r1")
        finally:
            gate.open()
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RequestReleased):  # and after it, the tombstone says the same
            await service.encode("r1", ["img:a"], receive_count=1)


async def test_the_tombstone_limit_forgets_the_oldest_ended_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With room for two tombstones, a third ended request pushes out the first: the newest
    (whose rank may still retry a lost answer) is remembered, the oldest is not."""
    fabric = InMemoryFabric()
    settings = ServiceSettings(remember_released=2)
    async with EncodeService.running(
        engine=fabric.engine("encoder"), encoder=WatchedEncoder(), settings=settings
    ) as service:
        rank = fabric.engine("rank0")
        buffer = torch.zeros(1 << 16, dtype=torch.uint8)
        await rank.register(int(buffer.data_ptr()), buffer.numel())
        receiver = Receiver(rank.session_id, int(buffer.data_ptr()))
        for req_id in ("r1", "r2", "r3"):
            await service.encode(req_id, ["img:a"], receive_count=1)
            await service.send(req_id, receiver)
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(1)
        assert (await service.send("r3", receiver)).repeat  # its lost answer, again
        assert (await service.send("r2", receiver)).repeat
        with pytest.raises(UnknownRequest):
            await service.send("r1", receiver)


async def test_a_retry_joining_a_failing_send_raises_its_own_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A rank's retry joins its send still in flight; when the transfer fails, each waiter
    raises an exception of its own (one object raised in both tasks would carry both their
    tracebacks, and keep both frames alive, for as long as either is kept)."""
    async with lifecycle_rig(transfer_latency=1.0) as rig:
        encode, _ = rig.encoder("r1", seed=5)
        await rig.open("r1", encode, receive_count=2)
        (a,) = await rig.landings(1)
        rig.sender.fail_next("transfer", TRANSFER_FAILED)
        first, retry = await gather_sends(rig, "r1", [a.receiver, a.receiver])
        assert rig.sender.count("transfer") == 1  # the retry joined the first send
        assert isinstance(first, EngineError)
        assert isinstance(retry, EngineError)
        assert first is not retry
        assert (first.call, first.code, str(first)) == (retry.call, retry.code, str(retry))
        for error in (first, retry):
            frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(error.__traceback__)]
            assert frames.count("send") == 1, frames  # its own raise, no other waiter's
            assert error.__context__ is None
