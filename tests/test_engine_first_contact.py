"""First-contact probes of new receivers, with a stand-in for Mooncake's binding.

``send_probe`` into a paused receiver blocks its thread until the peer resumes (~60 s in
Mooncake), long after the send's deadline gave up on it. These tests check that such threads
cannot use up the probe pool: sends to one receiver share one probe, a paused host holds a
bounded number of probe threads, and a receiver that failed is probed again later. Real
threads, so the real clock (a short deadline).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import trio

from trio_encode.engine import EngineError, Write
from trio_encode.engine.mooncake import (
    _PROBE_THREADS,
    PROBES_PER_HOST,
    MooncakeEngine,
    MooncakeSettings,
)

DEADLINE = 1.0
AT_ONCE = 0.4
"""A send that needs no paused probe's thread answers well within this (a healthy probe is a
thread start and back; generous for two shared, loaded cores)."""


class StandIn:
    """Mooncake's binding as the engine uses it: probes of a ``paused`` receiver block until
    :meth:`thaw`; transfers complete at once."""

    def __init__(self) -> None:
        self.paused: set[str] = set()
        self.refusing: set[str] = set()
        self.probes: Counter[str] = Counter()
        self.submitted: Counter[str] = Counter()
        self._thawed = threading.Event()
        self._lock = threading.Lock()

    def get_rpc_port(self) -> int:
        return 15000

    def send_probe(self, session_id: str) -> int:
        with self._lock:
            self.probes[session_id] += 1
        if session_id in self.paused:
            self._thawed.wait()
        return -1 if session_id in self.refusing else 0

    def thaw(self) -> None:
        self.paused.clear()
        self._thawed.set()

    def transfer_submit_write(self, session_id: str, src: int, dst: int, length: int) -> int:
        self.submitted[session_id] += 1
        return 1

    def transfer_check_status(self, batch_id: int) -> int:
        return 1


@pytest.fixture
def raw() -> Iterator[StandIn]:
    stand_in = StandIn()
    yield stand_in
    stand_in.thaw()  # no probe thread outlives the test


def engine(raw: StandIn) -> MooncakeEngine:
    return MooncakeEngine(raw, MooncakeSettings(first_contact_timeout=DEADLINE))


async def send(engine: MooncakeEngine, session_id: str) -> float:
    """One send's seconds; raises as the send does."""
    began = time.monotonic()
    await engine.transfer(Write(session_id, [(0x1000, 64)], 0x2000))
    return time.monotonic() - began


async def fails(engine: MooncakeEngine, session_id: str, seconds: list[float]) -> None:
    began = time.monotonic()
    with pytest.raises(EngineError, match="first-contact probe"):
        await send(engine, session_id)
    seconds.append(time.monotonic() - began)


async def test_concurrent_first_sends_to_a_paused_receiver_share_one_probe(raw: StandIn) -> None:
    """48 sends to one paused, new receiver: one probe thread, all fail at its deadline, and
    a new healthy receiver's first send is served at once meanwhile (it once got no probe
    thread: 16 such sends took them all)."""
    e = engine(raw)
    raw.paused.add("10.0.0.1:1")
    failed: list[float] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(48):
                nursery.start_soon(fails, e, "10.0.0.1:1", failed)
            await trio.sleep(0.2)
            assert await send(e, "10.0.0.2:1") < AT_ONCE
    assert raw.probes == Counter({"10.0.0.1:1": 1, "10.0.0.2:1": 1})
    assert len(failed) == 48
    assert max(failed) < DEADLINE + AT_ONCE
    assert raw.submitted == Counter({"10.0.0.2:1": 1})


async def test_a_waiter_keeps_its_own_cancellation(raw: StandIn) -> None:
    """A send that joined another's probe leaves when its own deadline comes; the probe and
    the other waiters go on."""
    e = engine(raw)
    raw.paused.add("10.0.0.1:1")
    failed: list[float] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails, e, "10.0.0.1:1", failed)
            await trio.sleep(0.1)
            began = time.monotonic()
            with trio.move_on_after(0.2) as scope:
                await send(e, "10.0.0.1:1")
            assert scope.cancelled_caught
            assert time.monotonic() - began < 0.2 + AT_ONCE
    assert raw.probes["10.0.0.1:1"] == 1
    assert len(failed) == 1


async def test_a_paused_node_holds_a_bounded_share_of_the_probe_threads(raw: StandIn) -> None:
    """Every rank of one host paused at first contact (more ranks than the pool has threads):
    that host holds at most PROBES_PER_HOST probe threads, a send to a further new receiver of
    that host then fails at once, and a new receiver on another host is served at once."""
    assert PROBES_PER_HOST < _PROBE_THREADS
    e = engine(raw)
    ranks = [f"10.0.0.1:{port}" for port in range(_PROBE_THREADS + 4)]
    raw.paused.update(ranks)
    failed: list[float] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for rank in ranks:
                nursery.start_soon(fails, e, rank, failed)
        assert sum(raw.probes.values()) == PROBES_PER_HOST
        # All of that host's probe threads are abandoned now: its next new receiver fails
        # at once, with no probe, and another host's new receiver is served at once.
        quick: list[float] = []
        await fails(e, "10.0.0.1:99", quick)
        assert quick[0] < AT_ONCE
        assert raw.probes["10.0.0.1:99"] == 0
        assert await send(e, "10.0.0.3:1") < AT_ONCE
    assert len(failed) == len(ranks)


async def test_a_receiver_that_failed_its_probe_is_probed_again_later(raw: StandIn) -> None:
    """A paused receiver's probe is abandoned at its deadline; later sends start no second
    probe while its thread runs, but wait for its answer, each within its own deadline (one
    whose peer resumes meanwhile is served). A probe that failed is not remembered: once its
    thread returned, the next send probes again, answered failures included."""
    e = engine(raw)
    raw.paused.add("10.0.0.1:1")
    with trio.fail_after(10):
        failed: list[float] = []
        await fails(e, "10.0.0.1:1", failed)
        await fails(e, "10.0.0.1:1", failed)
        assert min(failed) >= DEADLINE * 0.9
        assert raw.probes["10.0.0.1:1"] == 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, e, "10.0.0.1:1")
            await trio.sleep(0.2)
            raw.thaw()  # the peer resumes: the abandoned probe answers this send
        assert raw.probes["10.0.0.1:1"] == 1

        # Paused then refusing: the abandoned probe's late failure is not kept either.
        raw.paused.add("10.0.0.2:1")
        raw.refusing.add("10.0.0.2:1")
        raw._thawed.clear()
        await fails(e, "10.0.0.2:1", failed)
        raw.thaw()
        while e._probing:  # noqa: ASYNC110 (the abandoned thread returns on its own)
            await trio.sleep(0.01)
        for _ in range(2):
            with pytest.raises(EngineError, match="probe failed with -1"):
                await send(e, "10.0.0.2:1")
        assert raw.probes["10.0.0.2:1"] == 3
        raw.refusing.clear()
        await send(e, "10.0.0.2:1")
        assert raw.probes["10.0.0.2:1"] == 4
    assert raw.submitted == Counter({"10.0.0.1:1": 1, "10.0.0.2:1": 1})
