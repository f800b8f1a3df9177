"""The metadata pull (SGLang's ``/scheduler_receive_meta_data``) on the mock clock.

TP ranks pull a part's sizes, possibly before the tokenizer's ``/encode`` has arrived, then
send with the count. Every pull is bounded (by ``pull_timeout`` until an ``/encode`` names the
id, then by the scope's deadline) and a pull that goes away leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import trio
import trio.testing

from support.lifecycle_rig import Landing, SeededEncoder, landing_on, make_embedding
from trio_encode.embedding import Embedding
from trio_encode.errors import (
    EncodeFailed,
    EncodeNotArrived,
    InvalidInput,
    RequestError,
    ScopeExpired,
    ShuttingDown,
)
from trio_encode.request_types import SendReport
from trio_encode.service import EncodeReport, EncodeService, ServiceSettings
from trio_encode.testing.memory_engine import InMemoryEngine, InMemoryFabric

TP = 4


class ScriptedEncoder(SeededEncoder):
    """No threads; ``img:`` items encode in 1 s of virtual time, ``fail:`` ones raise and
    ``slow:`` ones take 1000 s."""

    async def load_items(self, items: Sequence[str], modality: str = "IMAGE") -> list[bytes]:
        if any(not item.startswith(("img:", "fail:", "slow:")) for item in items):
            raise InvalidInput("not an image")
        return [item.encode() for item in items]

    async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> Embedding:
        await trio.sleep(1000.0 if any(i.startswith(b"slow:") for i in images) else 1.0)
        if any(image.startswith(b"fail:") for image in images):
            raise RuntimeError("the vision tower raised")
        return make_embedding(len(b"".join(images)))


@dataclass
class World:
    service: EncodeService
    sender: InMemoryEngine
    ranks: list[Landing]
    fabric: InMemoryFabric

    async def assert_nothing_held(self) -> None:
        await trio.testing.wait_all_tasks_blocked()
        assert len(self.service.registry) == 0
        assert len(self.service.arrivals) == 0
        assert self.service.ledger.live_registrations == 0
        assert self.sender.live_registrations == {}
        assert self.fabric.violations == []


@asynccontextmanager
async def world(**settings: float) -> AsyncIterator[World]:
    fabric = InMemoryFabric()
    sender = fabric.engine("encoder")
    ranks = []
    for i in range(TP):
        ranks.append(await landing_on(fabric, f"rank{i}"))
    with trio.fail_after(3600):
        async with EncodeService.running(
            engine=sender, encoder=ScriptedEncoder(), settings=ServiceSettings(**settings)
        ) as service:
            yield World(service, sender, ranks, fabric)


async def _outcome(call: object) -> object:
    try:
        return await call  # type: ignore[misc]
    except RequestError as exc:
        return exc


async def test_pulls_before_the_encode_wait_for_it_then_every_rank_sends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """SGLang's order: all ranks pull first; the tokenizer's /encode (no count) comes 5 s
    later; each rank then sends with receive_count=TP; every copy lands and all is released."""
    async with world() as w:
        pulled: list[object] = []
        sent: list[object] = []

        async def rank(r: Landing) -> None:
            pulled.append(await _outcome(w.service.pull("r1")))
            sent.append(await _outcome(w.service.send("r1", r.receiver, receive_count=TP)))

        async with trio.open_nursery() as nursery:
            for r in w.ranks:
                nursery.start_soon(rank, r)
            await trio.testing.wait_all_tasks_blocked()
            assert len(w.service.arrivals) == 1  # four pulls, one waiting entry
            await trio.sleep(5.0)
            report = await w.service.encode("r1", ["img:a", "img:b"], receive_count=None)

        assert all(isinstance(p, EncodeReport) for p in pulled), pulled
        assert {p.shape for p in pulled if isinstance(p, EncodeReport)} == {report.shape}
        assert all(isinstance(s, SendReport) and s.receive_count == TP for s in sent), sent
        expected = bytes(make_embedding(len(b"img:aimg:b")).tensor.numpy().tobytes())
        for r in w.ranks:
            assert r.landed(len(expected)) == expected
        await w.assert_nothing_held()


async def test_a_pull_after_the_encode_answers_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w:
        encoded = await w.service.encode("r1", ["img:a"], receive_count=None)
        before = trio.current_time()
        pulled = await w.service.pull("r1")
        assert trio.current_time() == before
        assert pulled.shape == encoded.shape
        for r in w.ranks:
            await w.service.send("r1", r.receiver, receive_count=TP)
        await w.assert_nothing_held()


async def test_a_pull_naming_the_count_fixes_it(autojump_clock: trio.testing.MockClock) -> None:
    async with world() as w:
        await w.service.encode("r1", ["img:a"], receive_count=None)
        assert (await w.service.pull("r1", receive_count=2)).receive_count == 2
        first = await w.service.send("r1", w.ranks[0].receiver)
        assert first.receive_count == 2
        assert first.receivers_done == 1
        await w.service.send("r1", w.ranks[1].receiver)
        await w.assert_nothing_held()


async def test_a_pull_for_an_id_never_encoded_gives_up_at_pull_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world(pull_timeout=20.0) as w:
        with pytest.raises(EncodeNotArrived, match="within 20 s"):
            await w.service.pull("ghost")
        assert trio.current_time() == pytest.approx(20.0)
        await w.assert_nothing_held()


async def test_a_puller_that_goes_away_leaves_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cancelled while waiting for an /encode, and while waiting for the encode itself."""
    async with world() as w:
        with trio.move_on_after(3.0):
            await w.service.pull("ghost")
        assert len(w.service.arrivals) == 0

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: w.service.encode("r2", ["img:x"], receive_count=None))
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.5):
                await w.service.pull("r2")
        scope = w.service.registry.require_live("r2")
        for r in w.ranks:  # the abandoned pull changed nothing: all four still land
            await w.service.send("r2", r.receiver, receive_count=TP)
        await scope.wait_ended()
        assert scope.end_reason == "completed"
        await w.assert_nothing_held()


async def test_pulls_of_a_failed_encode_get_its_error_before_and_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Story 8: a failed encode must not leave sibling pulls waiting."""
    async with world() as w:
        early: list[object] = []
        async with trio.open_nursery() as nursery:
            for _ in range(TP):
                nursery.start_soon(lambda: _append(early, w.service.pull("r1")))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(EncodeFailed):
                await w.service.encode("r1", ["fail:x"], receive_count=None)
        assert all(isinstance(e, EncodeFailed) for e in early), early
        with pytest.raises(EncodeFailed, match="vision tower"):
            await w.service.pull("r1")
        await w.assert_nothing_held()


async def _append(into: list[object], call: object) -> None:
    into.append(await _outcome(call))


async def test_a_pull_is_bounded_by_the_scope_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world(send_timeout=60.0) as w:
        async with trio.open_nursery() as nursery:
            slow = w.service.encode("r1", ["slow:x"], receive_count=None)
            nursery.start_soon(_outcome, slow)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(ScopeExpired):
                await w.service.pull("r1")
        assert trio.current_time() == pytest.approx(60.0)
        await w.assert_nothing_held()


async def test_shutdown_wakes_pulls_waiting_for_an_encode(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world(pull_timeout=1000.0) as w:
        outcome: list[object] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _append(outcome, w.service.pull("ghost")))
            await trio.testing.wait_all_tasks_blocked()
            await w.service.shutdown()
        assert isinstance(outcome[0], ShuttingDown)
        assert trio.current_time() < 1.0
        await w.assert_nothing_held()


async def test_pulls_waiting_for_an_encode_with_bad_input_get_its_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The tokenizer's /encode is refused (bad input, no scope): pulls already waiting for it
    get the same 400 at once instead of waiting for pull_timeout; nothing is left."""
    async with world(pull_timeout=1000.0) as w:
        outcomes: list[object] = []
        async with trio.open_nursery() as nursery:
            for _ in range(TP):
                nursery.start_soon(lambda: _append(outcomes, w.service.pull("r1")))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(InvalidInput):
                await w.service.encode("r1", ["not an image"], receive_count=None)
        assert [type(o) for o in outcomes] == [InvalidInput] * TP
        assert trio.current_time() < 1.0
        await w.assert_nothing_held()
