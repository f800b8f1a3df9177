"""Transfers in flight hold no thread: the engine's one poller waits for every batch.

A real Mooncake engine moves the bytes to a real receiver; receivers that are "frozen" are
answered by :class:`FrozenReceivers`, which gives their submissions batches that stay running
(``transfer_check_status`` 0) until thawed, as a paused rank's do, and catches any batch asked
about after its terminal status (Mooncake frees it then). Real threads, so the real clock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from typing import Any

import pytest
import torch
import trio

from trio_encode.engine import EngineError, Write
from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings

SIZE = 64 * 1024
AT_ONCE = 1.0
"""A send that waits for nothing a frozen receiver holds answers well within this (a loopback
transfer of 64 KiB; generous for two shared, loaded cores)."""


class FrozenReceivers:
    """A real Mooncake binding, except for receivers named in ``frozen``-able sessions (any
    session id that is not a real engine's): their submissions get batches that run until
    :meth:`thaw`, then complete. Asking about a batch that already ended is recorded."""

    def __init__(self, raw: Any, real: set[str]) -> None:
        self._raw = raw
        self._real = real
        self._ids = itertools.count(1 << 60)
        self._lock = threading.Lock()
        self.batches: dict[int, str] = {}
        """Fake batch id -> its receiver."""
        self.ended: set[int] = set()
        self.thawed: set[str] = set()
        self.submitted: Counter[str] = Counter()
        self.asked_after_end: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def send_probe(self, session_id: str) -> int:
        return int(self._raw.send_probe(session_id)) if session_id in self._real else 0

    def transfer_submit_write(self, session_id: str, src: int, dst: int, length: int) -> int:
        with self._lock:
            self.submitted[session_id] += 1
        if session_id in self._real:
            return int(self._raw.transfer_submit_write(session_id, src, dst, length))
        with self._lock:
            batch_id = next(self._ids)
            self.batches[batch_id] = session_id
        return batch_id

    def transfer_check_status(self, batch_id: int) -> int:
        with self._lock:
            session_id = self.batches.get(batch_id)
            if session_id is None:
                return int(self._raw.transfer_check_status(batch_id))
            if batch_id in self.ended:
                self.asked_after_end.append(batch_id)
                return -1
            if session_id not in self.thawed:
                return 0
            self.ended.add(batch_id)
            return 1

    def thaw(self, *session_ids: str) -> None:
        with self._lock:
            self.thawed.update(session_ids)

    @property
    def total_submitted(self) -> int:
        with self._lock:
            return sum(self.submitted.values())


async def engine_with(
    receiver: MooncakeEngine, **settings: Any
) -> tuple[MooncakeEngine, FrozenReceivers]:
    created = await MooncakeEngine.create(MooncakeSettings(**settings))
    raw = FrozenReceivers(created.raw, {receiver.session_id})
    return MooncakeEngine(raw, created.settings), raw


def frozen_sessions(hosts: int, per_host: int) -> list[str]:
    return [f"10.0.{h}.1:{port}" for h in range(hosts) for port in range(1, per_host + 1)]


async def until(condition: Any, seconds: float = 10.0) -> None:
    with trio.fail_after(seconds):
        while not condition():  # noqa: ASYNC110 (threads change what is watched)
            await trio.sleep(0.005)


async def timed_send(
    sender: MooncakeEngine, receiver: MooncakeEngine, source: torch.Tensor, landing: torch.Tensor
) -> float:
    """One real send into ``landing`` (zeroed first); its seconds, every byte checked."""
    landing.zero_()
    began = time.monotonic()
    await sender.transfer(
        Write(receiver.session_id, [(int(source.data_ptr()), SIZE)], int(landing.data_ptr()))
    )
    seconds = time.monotonic() - began
    assert torch.equal(landing, source)
    return seconds


@pytest.fixture
async def landing(
    mooncake_engines: tuple[MooncakeEngine, MooncakeEngine],
) -> Any:
    _, receiver = mooncake_engines
    source = torch.randint(0, 256, (SIZE,), dtype=torch.uint8)
    into = torch.zeros(SIZE, dtype=torch.uint8)
    await receiver.register(int(into.data_ptr()), SIZE)
    try:
        yield receiver, source, into
    finally:
        await receiver.deregister(int(into.data_ptr()))


async def test_sends_parked_on_frozen_receivers_hold_no_thread(landing: Any) -> None:
    """64 sends parked on 16 frozen receivers on 4 hosts, with 2 submission threads: every one
    is submitted (none waits for a thread the others hold), no thread is held while they wait,
    and a send to a healthy receiver is served at once. Thawed, all of them complete, and no
    batch is asked about after its end."""
    receiver, source, into = landing
    sender, raw = await engine_with(receiver, transfer_threads=2)
    await timed_send(sender, receiver, source, into)  # first contact made
    sessions = frozen_sessions(4, 4)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for session_id in sessions * 4:
                nursery.start_soon(sender.transfer, Write(session_id, [(0x1000, 64)], 0x2000))
            await until(lambda: raw.total_submitted == 1 + len(sessions) * 4)
            # Every submitting thread has returned (a parked send would hold its thread).
            await until(lambda: sender.threads.transfers.borrowed_tokens == 0)
            assert sender.poller.in_flight == len(sessions) * 4
            assert await timed_send(sender, receiver, source, into) < AT_ONCE
            raw.thaw(*sessions)
    assert sender.poller.in_flight == 0
    assert raw.asked_after_end == []
    assert not sender.reading(0x1000, 64)


async def test_the_poller_wakes_each_send_when_its_own_batches_end(landing: Any) -> None:
    """Two parked sends: thawing one receiver ends that send alone, at once; the other waits
    on. Once nothing is in flight the poller sleeps (no round of checks while idle)."""
    receiver, source, into = landing
    sender, raw = await engine_with(receiver)
    first, second = frozen_sessions(2, 1)
    ended: dict[str, float] = {}

    async def send(session_id: str) -> None:
        await sender.transfer(Write(session_id, [(0x1000, 64), (0x3000, 64)], 0x2000))
        ended[session_id] = time.monotonic()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, first)
            nursery.start_soon(send, second)
            await until(lambda: raw.total_submitted == 4)
            thawed = time.monotonic()
            raw.thaw(first)
            await until(lambda: first in ended)
            assert ended[first] - thawed < AT_ONCE
            await trio.sleep(0.1)
            assert second not in ended
            raw.thaw(second)
    assert raw.asked_after_end == []
    await timed_send(sender, receiver, source, into)
    rounds = sender.poller.rounds
    await trio.sleep(0.3)
    assert sender.poller.rounds == rounds, "the poller checks while nothing is in flight"


async def test_a_cancelled_send_leaves_at_once_and_its_batches_stay_reading(landing: Any) -> None:
    """A caller cancelled while its batches run in a frozen receiver gets Cancelled within a
    round; the poller hands the batches back (it asks no more), the source stays reading()
    until Mooncake ends them, and settled() returns once it has."""
    receiver, _, _ = landing
    sender, raw = await engine_with(receiver)
    (frozen,) = frozen_sessions(1, 1)
    submitted = trio.Event()
    with trio.fail_after(60):  # past the engine's own wait (30 s): a late caller fails below
        began = time.monotonic()
        with trio.move_on_after(0.3) as deadline:
            await sender.transfer(Write(frozen, [(0x1000, 64)], 0x2000), submitted=submitted)
        left = time.monotonic()
        assert left - began < 0.3 + AT_ONCE, "the cancelled caller waited for Mooncake"
        assert deadline.cancelled_caught
        assert submitted.is_set()
        assert sender.poller.in_flight == 0
        assert sender.reading(0x1000, 64), "a batch still running was forgotten"
        assert sender.reading(0x1000 + 63, 1)
        assert not sender.reading(0x1000 + 64, 64)
        await trio.sleep(0.2)
        assert sender.reading(0x1000, 64)
        raw.thaw(frozen)
        await sender.settled(0x1000, 64)
        assert not sender.reading(0x1000, 64)
        assert time.monotonic() - left < 0.2 + 0.05 + 1.0 + AT_ONCE
    assert raw.asked_after_end == []


async def test_the_engine_bounds_its_transfers_in_flight(landing: Any) -> None:
    """With room for 4 transfers in flight, 6 sends to frozen receivers on 6 hosts: 4 are
    submitted, 2 wait (not submitted); one of those cancelled leaves with nothing submitted;
    thawed, the others complete and the last waiting one goes through."""
    receiver, _, _ = landing
    sender, raw = await engine_with(receiver, transfers_in_flight=4)
    sessions = frozen_sessions(6, 1)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for session_id in sessions[:5]:
                nursery.start_soon(sender.transfer, Write(session_id, [(0x1000, 64)], 0x2000))
            await until(lambda: raw.total_submitted == 4)
            await until(lambda: sender.threads.in_flight.statistics().tasks_waiting == 1)
            submitted = trio.Event()
            with trio.move_on_after(0.3) as gone:
                await sender.transfer(
                    Write(sessions[5], [(0x1000, 64)], 0x2000), submitted=submitted
                )
            assert gone.cancelled_caught
            assert not submitted.is_set()
            assert raw.total_submitted == 4
            raw.thaw(*sessions)
    assert raw.submitted[sessions[5]] == 0
    assert raw.total_submitted == 5
    assert raw.asked_after_end == []


class Refusing(FrozenReceivers):
    """Refuses every submission to ``10.0.9.1:1`` (-1, no batch) and raises on ``10.0.9.2:1``
    (the binding's own error)."""

    def transfer_submit_write(self, session_id: str, src: int, dst: int, length: int) -> int:
        if session_id == "10.0.9.1:1":
            return -1
        if session_id == "10.0.9.2:1":
            raise RuntimeError("the binding broke")
        return super().transfer_submit_write(session_id, src, dst, length)


async def test_a_submission_that_sends_the_poller_nothing_answers_at_once(
    mooncake_engines: tuple[MooncakeEngine, MooncakeEngine],
) -> None:
    """A refused submission fails the send with -1, and a binding that raises raises in the
    caller; neither leaves a thread, a slot or a flight behind."""
    _, receiver = mooncake_engines
    created = await MooncakeEngine.create(MooncakeSettings())
    sender = MooncakeEngine(Refusing(created.raw, {receiver.session_id}), created.settings)
    with trio.fail_after(10):
        with pytest.raises(EngineError) as refused:
            await sender.transfer(Write("10.0.9.1:1", [(0x1000, 64)], 0x2000))
        assert refused.value.code == -1
        with pytest.raises(RuntimeError, match="the binding broke"):
            await sender.transfer(Write("10.0.9.2:1", [(0x1000, 64)], 0x2000))
    assert sender.threads.transfers.borrowed_tokens == 0
    assert sender.threads.in_flight.borrowed_tokens == 0
    assert sender.threads.bounds_held == 0
    assert sender.poller.in_flight == 0
    assert not sender.reading(0x1000, 64)
