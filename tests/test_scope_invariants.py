"""The lifecycle invariants, one failure class each, on the mock clock with forced interleavings.

Each test is named after a failure that SGLang, vLLM or Dynamo shipped (``docs/failures.md``); the
numbers in the docstrings are the invariants of ``lifecycle.md`` it holds the scope to.
"""

from __future__ import annotations

import logging
import weakref

import pytest
import torch
import trio
import trio.testing

from support.lifecycle_rig import gather_sends, lifecycle_rig, make_embedding
from trio_encode.embedding import Embedding
from trio_encode.engine import TRANSFER_FAILED, EngineError
from trio_encode.errors import (
    EncodeFailed,
    InvalidInput,
    ReceiveCountConflict,
    RequestReleased,
    ScopeExpired,
    ShuttingDown,
    UnknownRequest,
)
from trio_encode.request_types import SendReport

NBYTES = 64 * 32 * 4


async def test_sibling_sends_register_once(autojump_clock: trio.testing.MockClock) -> None:
    """Invariant 1, failure 1: four TP siblings send at once while the first is still
    registering; the memory is registered once, not four times (-7)."""
    async with lifecycle_rig(register_latency=1.0, transfer_latency=0.5) as rig:
        encode, _ = rig.encoder("r1", seed=1)
        await rig.open("r1", encode, receive_count=4)
        ranks = await rig.landings(4)
        gate = rig.sender.gate("register")
        scope = rig.registry.require_live("r1")

        async with trio.open_nursery() as nursery:
            results: list[object] = []

            async def run() -> None:
                results.extend(await gather_sends(rig, "r1", [r.receiver for r in ranks]))

            nursery.start_soon(run)
            try:
                # Force the race: every sibling has arrived while the one registration is held.
                await gate.wait_arrivals(1)
                await trio.testing.wait_all_tasks_blocked()
                assert gate.waiting == 1
            finally:
                gate.open()
        await scope.wait_ended()

        assert all(isinstance(r, SendReport) for r in results), results
        assert rig.sender.count("register") == 1
        assert rig.sender.count("deregister") == 1
        for rank in ranks:
            assert rank.landed(NBYTES) == rig.expected["r1"]
        await rig.assert_nothing_held()


async def test_embedding_is_dropped_only_after_deregistration(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 3, failure 2: a fast sibling finishing must not drop the embedding a slow
    sibling still sends; it is dropped once, after the deregistration returned."""
    async with lifecycle_rig() as rig:
        encode, alive = rig.encoder("r1", seed=2)
        await rig.open("r1", encode, receive_count=2)
        fast, slow = await rig.landings(2)
        rig.sender.script_latency("transfer", [0.1, 5.0])
        rig.sender.script_latency("deregister", [1.0])  # so "before" and "after" differ
        dropped_at: list[float] = []

        def note_drop() -> None:
            dropped_at.append(trio.current_time())

        embedding = alive()
        assert embedding is not None
        weakref.finalize(embedding, note_drop)
        del embedding

        scope = rig.registry.require_live("r1")
        results = await gather_sends(rig, "r1", [fast.receiver, slow.receiver])
        await scope.wait_ended()

        assert all(isinstance(r, SendReport) for r in results), results
        transfers = rig.sender.calls("transfer")
        deregister = rig.sender.calls("deregister")[0]
        assert deregister.end is not None
        assert all(t.end is not None and t.end <= deregister.start for t in transfers)
        assert len(dropped_at) == 1
        assert dropped_at[0] >= deregister.end
        assert slow.landed(NBYTES) == rig.expected["r1"]
        await rig.assert_nothing_held()


async def test_transfer_error_is_raised_with_its_code(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 6, failure 3: a failing transfer is an error with the engine's code, not a
    silent success; the siblings are still served and a retry succeeds."""
    async with lifecycle_rig() as rig:
        encode, _ = rig.encoder("r1", seed=3)
        await rig.open("r1", encode, receive_count=2)
        a, b = await rig.landings(2)
        rig.sender.fail_next("transfer", TRANSFER_FAILED)

        scope = rig.registry.require_live("r1")
        with pytest.raises(EngineError) as failed:
            await scope.send(a.receiver)
        assert (failed.value.call, failed.value.code) == ("transfer", TRANSFER_FAILED)
        assert rig.observer.names("engine_error") == [("transfer", TRANSFER_FAILED)]
        assert scope.receivers_done == 0

        report = await scope.send(a.receiver)  # the retry
        assert report.receivers_done == 1
        await scope.send(b.receiver)
        assert a.landed(NBYTES) == b.landed(NBYTES) == rig.expected["r1"]
        await rig.assert_nothing_held()


async def test_registration_failure_reaches_every_sibling(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 6, failure 4: a failed registration is not swallowed by a wrapper that logs
    it; the sibling that hit it gets the engine's code and later siblings try again."""
    async with lifecycle_rig(register_latency=0.2) as rig:
        encode, _ = rig.encoder("r1", seed=4)
        await rig.open("r1", encode, receive_count=2)
        a, b = await rig.landings(2)
        rig.sender.fail_next("register", -1)

        results = await gather_sends(rig, "r1", [a.receiver, b.receiver])

        errors = [r for r in results if isinstance(r, EngineError)]
        assert len(errors) == 1
        assert (errors[0].call, errors[0].code) == ("register", -1)
        assert rig.observer.names("engine_error") == [("register", -1)]  # counted once
        # The other sibling registered again itself and was served.
        assert sum(isinstance(r, SendReport) for r in results) == 1
        assert rig.sender.count("register") == 2
        scope = rig.registry.require_live("r1")
        await scope.send(a.receiver if isinstance(results[0], EngineError) else b.receiver)
        await rig.assert_nothing_held()


async def test_registration_is_released_when_the_transfer_raises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 2, failure 5: the registration made for a transfer that then failed is still
    deregistered, exactly once, when the scope ends."""
    async with lifecycle_rig(send_timeout=30) as rig:
        encode, _ = rig.encoder("r1", seed=5)
        await rig.open("r1", encode, receive_count=1)
        (a,) = await rig.landings(1)
        rig.sender.fail_next("transfer", TRANSFER_FAILED)
        with pytest.raises(EngineError):
            await rig.registry.require_live("r1").send(a.receiver)
        assert rig.ledger.live_registrations == 1  # held for the retry, not leaked...

        await rig.registry.require_live("r1").wait_ended()  # ...until the backstop ends the scope
        assert rig.sender.count("register") == rig.sender.count("deregister") == 1
        await rig.assert_nothing_held()


@pytest.mark.parametrize("ending", ["backstop", "shutdown"])
async def test_scope_waits_for_a_transfer_stuck_in_its_thread(
    autojump_clock: trio.testing.MockClock, ending: str
) -> None:
    """Invariants 2 and 4, failure 6: the backstop fires (or the server stops) while a transfer
    runs in a worker thread; the memory is deregistered only after that transfer returned,
    and the scope ends no later than that."""
    async with lifecycle_rig(send_timeout=10) as rig:
        encode, alive = rig.encoder("r1", seed=6)
        await rig.open("r1", encode, receive_count=2)
        a, b = await rig.landings(2)
        scope = rig.registry.require_live("r1")
        rig.sender.script_latency("transfer", [25.0])  # runs past the 10 s deadline

        async with trio.open_nursery() as nursery:
            outcomes: dict[str, object] = {}

            async def send(name: str, landing: object) -> None:
                try:
                    outcomes[name] = await scope.send(landing.receiver)  # type: ignore[attr-defined]
                except Exception as exc:
                    outcomes[name] = exc

            nursery.start_soon(send, "a", a)
            await trio.testing.wait_all_tasks_blocked()
            assert len(rig.sender.in_flight) == 1
            if ending == "shutdown":
                await trio.sleep(3)
                scope.cancel()
            else:
                await trio.sleep(11)
            assert rig.ledger.live_registrations == 1  # the thread still reads from it
            nursery.start_soon(send, "b", b)  # arrives while the scope is ending
        await scope.wait_ended()

        transfer = rig.sender.calls("transfer")[0]
        deregister = rig.sender.calls("deregister")[0]
        assert transfer.end == 25.0 + transfer.start
        assert deregister.start >= transfer.end
        assert rig.fabric.violations == []
        # The thread's transfer completed and counts; the waiting sibling was answered.
        assert isinstance(outcomes["a"], SendReport)
        assert a.landed(NBYTES) == rig.expected["r1"]
        expected_error = ScopeExpired if ending == "backstop" else ShuttingDown
        assert isinstance(outcomes["b"], expected_error), outcomes["b"]
        assert alive() is None
        assert scope.end_reason == ("expired" if ending == "backstop" else "shutdown")
        await rig.assert_nothing_held()


async def test_retry_from_the_same_receiver_is_not_a_new_receiver(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 5, failure 7: a rank that retries (after a timeout on its side) must not count
    twice, or cleanup would run while the other rank still needs the memory."""
    async with lifecycle_rig(transfer_latency=1.0) as rig:
        encode, _ = rig.encoder("r1", seed=7)
        await rig.open("r1", encode, receive_count=2)
        a, b = await rig.landings(2)
        scope = rig.registry.require_live("r1")

        # A retry while the first attempt is in flight joins it: one transfer, not two.
        results = await gather_sends(rig, "r1", [a.receiver, a.receiver])
        assert all(isinstance(r, SendReport) for r in results)
        assert rig.sender.count("transfer") == 1
        # A retry after success sends again but is still one receiver.
        report = await scope.send(a.receiver)
        assert report.receivers_done == 1
        assert scope.end_reason is None
        assert rig.ledger.live_registrations == 1

        report = await scope.send(b.receiver)
        assert report.receivers_done == 2
        await rig.assert_completed(scope)


async def test_failed_encode_answers_every_waiting_sender(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 4, failure 8: a failed encode must not leave sibling sends waiting for the
    backstop; they all get the encoder's error at once, and so do later calls."""
    async with lifecycle_rig(send_timeout=180) as rig:
        encode = rig.failing_encoder()
        encode.error = RuntimeError("the vision tower ran out of memory")  # a model crash
        encode.latency = 2.0
        await rig.open("r1", encode, receive_count=3)
        ranks = await rig.landings(3)

        results = await gather_sends(rig, "r1", [r.receiver for r in ranks])

        assert trio.current_time() == pytest.approx(2.0)
        assert all(isinstance(r, EncodeFailed) for r in results)
        assert all("ran out of memory" in str(r) for r in results)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(EncodeFailed):
            rig.registry.require_live("r1")
        assert rig.sender.count("register") == 0
        await rig.assert_nothing_held()


async def test_cancel_while_waiting_for_the_encoder_leaves_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 4, failure 9: a request whose encode never starts (stuck in the queue) is
    cancelled by its backstop; the encoder sees the cancellation and nothing stays behind."""
    async with lifecycle_rig(send_timeout=60) as rig:
        encode, alive = rig.encoder("r1", seed=9)
        encode.gate = trio.Event()  # the queue never gets to it
        await rig.open("r1", encode, receive_count=1)
        (a,) = await rig.landings(1)
        scope = rig.registry.require_live("r1")

        with pytest.raises(ScopeExpired):
            await scope.send(a.receiver)
        assert trio.current_time() == pytest.approx(60.0)
        await scope.wait_ended()
        assert encode.cancelled
        assert ("r1",) in rig.observer.names("backstop_expired")
        with pytest.raises(RequestReleased):
            rig.registry.require_live("r1")
        del alive
        await rig.assert_nothing_held()


async def test_two_requests_sharing_memory_register_it_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 1, failure 10: an embedding-cache hit hands the same tensor to two requests;
    the second must lease the live registration, not register the same bytes again (-7), and
    the memory stays registered until the last of them is done."""
    async with lifecycle_rig() as rig:
        shared = make_embedding(10)
        encode_a, _ = rig.encoder("a", shared)
        encode_b, _ = rig.encoder("b", shared)
        del shared
        await rig.open("a", encode_a)
        await rig.open("b", encode_b)
        ra, rb = await rig.landings(2)
        gate = rig.sender.gate("transfer")

        async with trio.open_nursery() as nursery:
            try:
                nursery.start_soon(gather_sends, rig, "a", [ra.receiver])
                await gate.wait_arrivals(1)  # a is mid-transfer, holding the registration
                nursery.start_soon(gather_sends, rig, "b", [rb.receiver])
                with trio.fail_after(60):  # b gets past registration with no second register
                    await gate.wait_arrivals(2)
                assert rig.sender.count("register") == 1
            finally:
                gate.open()  # a held "thread" must never outlive a failed assertion

        await trio.testing.wait_all_tasks_blocked()  # both scopes have released
        assert rig.sender.count("register") == rig.sender.count("deregister") == 1
        assert ra.landed(NBYTES) == rb.landed(NBYTES) == rig.expected["a"]
        await rig.assert_nothing_held()


async def test_views_of_one_batch_output_never_register_the_same_bytes_twice(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 1, failure 10: requests get views into one batched output; disjoint views are
    registered separately (they do not overlap), a view inside a live registration leases it,
    and a view that straddles one is sent from a private copy."""
    async with lifecycle_rig() as rig:
        batch = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(11))
        rows = batch.view(4 * 64, 32)
        views = {
            "first": Embedding(batch[0]),  # rows 0..64
            "second": Embedding(batch[1]),  # rows 64..128: adjacent, not overlapping
            "inner": Embedding(rows[8:40]),  # inside "first"
            "straddling": Embedding(rows[32:96]),  # across "first" and "second"
        }
        for req_id, embedding in views.items():
            encode, _ = rig.encoder(req_id, embedding)
            await rig.open(req_id, encode)
        del views, batch, rows, embedding
        landings = {req_id: await rig.landing(NBYTES) for req_id in rig.expected}
        gate = rig.sender.gate("transfer")  # hold every transfer: all regions live at once

        async with trio.open_nursery() as nursery:
            try:
                for req_id, landing in landings.items():
                    nursery.start_soon(gather_sends, rig, req_id, [landing.receiver])
                    with trio.fail_after(60):
                        await gate.wait_arrivals(len(rig.sender.calls("transfer")) + 1)
                registers = rig.sender.calls("register")
                assert [call.ok for call in registers] == [True, True, True]
                assert rig.ledger.live_registrations == 3
            finally:
                gate.open()

        for req_id, landing in landings.items():
            size = len(rig.expected[req_id])
            assert landing.landed(size) == rig.expected[req_id], req_id
        await rig.assert_nothing_held()


async def test_client_disconnect_before_its_transfer_starts_withdraws_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 7: a handler cancelled while its send waits for the encoder withdraws the
    send: it never starts, is not counted, and the scope keeps serving the others."""
    async with lifecycle_rig() as rig:
        encode, _ = rig.encoder("r1", seed=12, latency=5.0)
        await rig.open("r1", encode, receive_count=2)
        a, b = await rig.landings(2)
        scope = rig.registry.require_live("r1")

        with trio.move_on_after(1.0) as gone:  # the client disconnects after 1 s
            await scope.send(a.receiver)
        assert gone.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(10)
        assert rig.sender.count("transfer") == 0
        assert scope.receivers_done == 0
        assert a.landed(NBYTES) == bytes(NBYTES)

        await scope.send(b.receiver)
        report = await scope.send(a.receiver)  # the client reconnects and retries
        assert report.receivers_done == 2
        await rig.assert_nothing_held()


async def test_client_disconnect_during_its_transfer_completes_and_counts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 7: a handler cancelled while its transfer runs does not cancel the transfer
    (it is the scope's task, not the handler's): the bytes land and the receiver counts."""
    async with lifecycle_rig() as rig:
        encode, _ = rig.encoder("r1", seed=13)
        await rig.open("r1", encode, receive_count=2)
        a, b = await rig.landings(2)
        scope = rig.registry.require_live("r1")
        rig.sender.script_latency("transfer", [8.0])

        with trio.move_on_after(1.0) as gone:
            await scope.send(a.receiver)
        assert gone.cancelled_caught
        await trio.sleep(10)
        assert scope.receivers_done == 1
        assert a.landed(NBYTES) == rig.expected["r1"]
        await scope.send(b.receiver)
        await rig.assert_nothing_held()


async def test_receiver_that_never_calls_cannot_hold_the_scope(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 4: with four ranks announced and three calling, the scope ends at its
    deadline, frees everything, and a late call gets 410, not a new scope."""
    async with lifecycle_rig(send_timeout=180) as rig:
        encode, alive = rig.encoder("r1", seed=14)
        await rig.open("r1", encode, receive_count=4)
        ranks = await rig.landings(4)
        results = await gather_sends(rig, "r1", [r.receiver for r in ranks[:3]])
        assert all(isinstance(r, SendReport) for r in results)
        assert rig.ledger.live_registrations == 1

        await rig.registry.require_live("r1").wait_ended()
        assert trio.current_time() == pytest.approx(180.0)
        assert alive() is None
        with pytest.raises(RequestReleased):
            await rig.registry.open("r1", receive_count=4, encode=encode)
        with pytest.raises(RequestReleased):
            rig.registry.require_live("r1")
        await rig.assert_nothing_held()


async def test_deregistration_failure_is_logged_and_counted(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Invariant 6: a failing deregistration is not swallowed: it is logged with the req_id
    and counted as an engine error; the ledger forgets the region either way."""
    async with lifecycle_rig() as rig:
        encode, _ = rig.encoder("r1", seed=15)
        await rig.open("r1", encode)
        (a,) = await rig.landings(1)
        rig.sender.fail_next("deregister", -3)
        with caplog.at_level(logging.ERROR, logger="trio_encode"):
            await rig.registry.require_live("r1").send(a.receiver)
            await trio.testing.wait_all_tasks_blocked()
        assert ("deregister", -3) in rig.observer.names("engine_error")
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert any(
            "code -3" in r.getMessage() and getattr(r, "req_id", None) == "r1" for r in errors
        )
        assert rig.ledger.live_registrations == 0
        assert len(rig.registry) == 0


async def test_registry_rules(autojump_clock: trio.testing.MockClock) -> None:
    """404 for a never-seen id, 409 for a conflicting receive_count, siblings share one scope,
    and bad input leaves only its failure, so a corrected retry can use the id."""
    async with lifecycle_rig() as rig:
        with pytest.raises(UnknownRequest):
            rig.registry.require_live("nope")
        encode, _ = rig.encoder("r1", seed=16)
        await rig.open("r1", encode, receive_count=2)
        same = await rig.registry.open("r1", receive_count=None, encode=encode)
        assert same is rig.registry.require_live("r1")
        await trio.testing.wait_all_tasks_blocked()
        assert encode.started == 1
        with pytest.raises(ReceiveCountConflict):
            await rig.registry.open("r1", receive_count=3, encode=encode)

        await rig.open_bad_input("bad")
        with pytest.raises(InvalidInput):  # a late send learns why; nothing else is left
            rig.registry.require_live("bad")
        corrected, _ = rig.encoder("bad", seed=17)
        await rig.open("bad", corrected, receive_count=1)
        assert rig.registry.require_live("bad").accepting


async def test_after_every_scope_ends_nothing_is_held(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 8: many requests ending every way there is (completed, encode failed,
    expired with a receiver missing, transfer failed, cut short by shutdown) leave no scope,
    registration or embedding behind."""
    async with lifecycle_rig(send_timeout=30, transfer_latency=0.25) as rig:
        ranks = await rig.landings(2)
        alive: list[weakref.ref[Embedding]] = []
        outcomes: list[object] = []
        for i in range(40):
            kind = ("complete", "encode_fails", "one_missing", "transfer_fails", "shutdown")[i % 5]
            req_id = f"r{i}"
            if kind == "encode_fails":
                await rig.open(req_id, rig.failing_encoder(), receive_count=2)
            else:
                encode, ref = rig.encoder(req_id, seed=100 + i, latency=0.1 * (i % 3))
                alive.append(ref)
                await rig.open(req_id, encode, receive_count=2)
            receivers = [r.receiver for r in (ranks if kind != "one_missing" else ranks[:1])]
            if kind == "transfer_fails":
                rig.sender.fail_next("transfer", TRANSFER_FAILED)
            if kind == "shutdown":
                rig.registry.require_live(req_id).cancel()
            outcomes += await gather_sends(rig, req_id, receivers)

        for scope in rig.registry.scopes():
            await scope.wait_ended()
        assert trio.current_time() <= 30 + 40 * 1.0
        assert all(ref() is None for ref in alive)
        assert any(isinstance(o, SendReport) for o in outcomes)
        assert any(isinstance(o, EngineError) for o in outcomes)
        assert any(isinstance(o, EncodeFailed) for o in outcomes)
        assert any(isinstance(o, ShuttingDown) for o in outcomes)
        await rig.assert_nothing_held()


async def test_cancelling_the_service_nursery_still_deregisters(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariants 2 and 8: when the whole service is cancelled (not a graceful shutdown), the
    scope's cleanup still runs to the end: it is shielded, so the deregistration is not
    cancelled before it starts."""
    async with lifecycle_rig() as rig:
        encode, alive = rig.encoder("r1", seed=17)
        await rig.open("r1", encode, receive_count=2)
        a, _ = await rig.landings(2)
        rig.sender.script_latency("deregister", [2.0])
        await rig.registry.require_live("r1").send(a.receiver)
        assert rig.ledger.live_registrations == 1
        rig.nursery.cancel_scope.cancel()
    assert rig.sender.live_registrations == {}
    assert rig.sender.count("deregister", ok=True) == 1
    assert alive() is None


async def test_retry_right_after_a_withdrawn_send_is_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 7: a client that disconnects and reconnects at once (before the withdrawn
    attempt has even noticed) gets a fresh attempt, not the withdrawn one's outcome."""
    async with lifecycle_rig() as rig:
        encode, _ = rig.encoder("r1", seed=18, latency=5.0)
        await rig.open("r1", encode, receive_count=1)
        (a,) = await rig.landings(1)
        scope = rig.registry.require_live("r1")
        with trio.move_on_after(1.0):
            await scope.send(a.receiver)
        report = await scope.send(a.receiver)  # no checkpoint in between
        assert report.receivers_done == 1
        assert rig.sender.count("transfer") == 1
        assert a.landed(NBYTES) == rig.expected["r1"]
        await rig.assert_nothing_held()
