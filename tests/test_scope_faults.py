"""Fault isolation: one request's, one rank's or one client's fault never reaches another.

Each test forces one interleaving on the mock clock that once let a fault escape its request
(``docs/failures.md`` lists the classes): a withdrawn send that still wrote, an opener's
disconnect that ended the request for its siblings, a transient refusal remembered as a
failure, a shutdown whose grace restarted when interrupted, an unexpected error that took the
service down, and a failed deregistration that freed memory the engine may still hold.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from support.lifecycle_rig import SeededEncoder, lifecycle_rig, make_embedding
from trio_encode.embedding import Embedding, checksum_of
from trio_encode.engine import INVALID_ADDRESS, TRANSFER_FAILED, EngineError
from trio_encode.engine.threads import ThreadSettings
from trio_encode.errors import (
    EncodeFailed,
    InternalError,
    Overloaded,
    RequestReleased,
    ShuttingDown,
)
from trio_encode.request_types import IMAGES, SendReport
from trio_encode.service import EncodeService, ServiceSettings
from trio_encode.testing.memory_engine import InMemoryFabric

NBYTES = 64 * 32 * 4


async def test_a_submitted_send_is_not_withdrawn_by_a_client_that_leaves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Once the engine has submitted a send (here into a rank that froze mid-transfer), a
    client that goes away does not withdraw it: the engine keeps waiting, and the client's
    retry joins it rather than starting a second transfer into the same buffer while the
    first may still write there."""
    async with lifecycle_rig(transfer_timeout=30.0, progress_timeout=60.0) as rig:
        encode, _ = rig.encoder("r1", seed=2)
        await rig.open("r1", encode, receive_count=1)
        (a,) = await rig.landings(1)
        scope = rig.registry.require_live("r1")
        rig.fabric.freeze(a.engine.session_id)
        with trio.move_on_after(1.0):  # the client leaves while its transfer hangs
            await scope.send(a.receiver)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scope.send, a.receiver)  # its retry
            await trio.sleep(1.0)
            rig.fabric.thaw(a.engine.session_id)
        assert rig.sender.count("transfer") == 1, "a second transfer into the same buffer"
        assert a.landed(NBYTES) == rig.expected["r1"]
        await rig.assert_completed(scope)


async def test_a_withdrawn_send_never_writes_after_its_retry_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client that goes away while its send is inside the (shielded) register call, then
    retries: the retry is answered once its bytes landed, and nothing writes into that
    buffer afterwards (the withdrawn attempt must not transfer on its own)."""
    async with lifecycle_rig() as rig:
        encode, _ = rig.encoder("r1", seed=1)
        await rig.open("r1", encode, receive_count=2)
        a, _b = await rig.landings(2)
        scope = rig.registry.require_live("r1")
        gate = rig.sender.gate("register")
        answered_at: list[float] = []

        async def retry() -> None:
            await scope.send(a.receiver)
            answered_at.append(trio.current_time())

        gone = trio.CancelScope()
        send_done = trio.Event()

        async def first_send() -> None:
            with gone:
                await scope.send(a.receiver)
            send_done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first_send)
            await gate.wait_arrivals(1)
            gone.cancel()  # the client disconnects mid-registration
            await send_done.wait()
            nursery.start_soon(retry)  # and retries
            await trio.testing.wait_all_tasks_blocked()
            gate.open()
        await trio.testing.wait_all_tasks_blocked()

        into_a = [
            c for c in rig.sender.calls("transfer") if c.remote_address == a.receiver.buffer_address
        ]
        assert len(into_a) == 1, into_a
        assert answered_at
        assert all(c.start <= answered_at[0] for c in into_a)
        assert a.landed(NBYTES) == rig.expected["r1"]


async def test_a_send_waiting_for_a_thread_is_withdrawn_when_its_client_leaves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Waiting for a transfer thread (or a slot of the receiver's bound) is not transferring:
    a client that leaves then withdraws its send, which never writes afterwards; its retry
    starts afresh and is served."""
    threads = ThreadSettings(transfer_threads=1, control_threads=1, sends_per_session=1)
    async with lifecycle_rig(threads=threads) as rig:
        encode, _ = rig.encoder("r1", seed=1)
        await rig.open("r1", encode, receive_count=2)
        busy, late = await rig.landings(2)
        scope = rig.registry.require_live("r1")
        gate = rig.sender.gate("transfer")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scope.send, busy.receiver)
            await gate.wait_arrivals(1)  # busy's transfer holds the only thread
            with trio.move_on_after(1) as gone:  # late's client leaves while its send waits
                await scope.send(late.receiver)
            assert gone.cancelled_caught
            gate.open()
        await trio.testing.wait_all_tasks_blocked()
        assert [c.remote_address for c in rig.sender.calls("transfer")] == [
            busy.receiver.buffer_address
        ], "a withdrawn send transferred"
        assert late.landed(NBYTES) == bytes(NBYTES)
        report = await scope.send(late.receiver)  # the retry is a new send
        assert not report.repeat
        assert late.landed(NBYTES) == rig.expected["r1"]
        await rig.assert_nothing_held()


class _SlowLoadEncoder(SeededEncoder):
    """Loads items in a "thread" that a cancelled caller still waits for (shielded), as
    ``trio.to_thread.run_sync(abandon_on_cancel=False)`` does."""

    def __init__(self, encode_error: Exception | None = None) -> None:
        self.encode_error = encode_error
        self.encodes = 0

    async def load_items(self, items: Sequence[str], modality: str = "IMAGE") -> list[bytes]:
        with trio.CancelScope(shield=True):
            await trio.sleep(1.0)
        return [item.encode() for item in items]

    async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> Embedding:
        self.encodes += 1
        embedding = await super().encode(images)
        if self.encode_error is not None:
            raise self.encode_error
        return embedding


async def test_an_openers_disconnect_does_not_end_the_request_for_its_siblings(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first /encode's client vanishes while its items load: the scope it opens must not
    inherit that cancellation; a sibling's /encode is served, not told 410."""
    fabric = InMemoryFabric()
    sender = fabric.engine("encoder")
    encoder = _SlowLoadEncoder()
    async with EncodeService.running(engine=sender, encoder=encoder) as service:
        with trio.move_on_after(0.5) as gone:
            await service.encode("r1", ["img:a"], receive_count=2)
        assert gone.cancelled_caught
        report = await service.encode("r1", ["img:a"], receive_count=2)
        assert report.shape.rows == 64
        assert encoder.encodes == 1
        scope = service.registry.require_live("r1")
        assert scope.accepting
        scope.cancel()


async def test_a_transient_refusal_leaves_nothing_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A 503 from the encoder (queue full) is not remembered as a failure: a later retry of
    the same req_id is encoded afresh instead of being told 500 for an hour."""
    fabric = InMemoryFabric()
    encoder = _SlowLoadEncoder(encode_error=Overloaded("the encoder queue is full"))
    async with EncodeService.running(engine=fabric.engine("encoder"), encoder=encoder) as service:
        with pytest.raises(Overloaded):
            await service.encode("r1", ["img:a"], receive_count=1)
        await trio.testing.wait_all_tasks_blocked()
        encoder.encode_error = None
        report = await service.encode("r1", ["img:a"], receive_count=1)
        assert report.shape.rows == 64
        assert encoder.encodes == 2
        service.registry.require_live("r1").cancel()


async def test_a_tombstone_keeps_no_exception_and_no_frame(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A failed request's tombstone holds its status and message, not the exception (whose
    traceback would keep the request's image bytes alive for an hour)."""

    class Payload:
        pass

    fabric = InMemoryFabric()
    payload_alive: list[weakref.ref[Payload]] = []

    class HoldingEncoder(_SlowLoadEncoder):
        async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> Embedding:
            payload = Payload()  # a local of the failing frame, as the image bytes are
            payload_alive.append(weakref.ref(payload))
            raise EncodeFailed("the model failed")

    async with EncodeService.running(
        engine=fabric.engine("encoder"), encoder=HoldingEncoder()
    ) as service:
        with pytest.raises(EncodeFailed):
            await service.encode("r1", ["img:a"], receive_count=1)
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        assert payload_alive[0]() is None
        with pytest.raises(EncodeFailed, match="the model failed"):
            await service.encode("r1", ["img:a"], receive_count=1)


async def test_interrupting_shutdown_cuts_the_grace_short(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A second shutdown request (a second Ctrl-C, or a cancel of the first) ends the grace
    period at once instead of starting it over; every registration is still released."""
    fabric = InMemoryFabric()
    settings = ServiceSettings(send_timeout=180, shutdown_grace=30)
    async with EncodeService.running(
        engine=fabric.engine("encoder"), encoder=_SlowLoadEncoder(), settings=settings
    ) as service:
        await service.encode("waiting", ["img:a"], receive_count=2)
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.shutdown)
            await trio.sleep(5)
            report = await service.shutdown()  # the second request
        assert trio.current_time() - started == pytest.approx(5)
        assert (report.finished, report.cut_short) == (0, 1)
    assert service.ledger.live_registrations == 0

    # A cancel of the one running shutdown cuts it short too, and still releases everything.
    async with EncodeService.running(
        engine=fabric.engine("encoder2"), encoder=_SlowLoadEncoder(), settings=settings
    ) as service:
        await service.encode("waiting", ["img:a"], receive_count=2)
        started = trio.current_time()
        with trio.move_on_after(5):
            await service.shutdown()
        assert trio.current_time() - started == pytest.approx(5)
        assert service.shutdown_report is not None
        assert service.shutdown_report.cut_short == 1
        assert len(service.registry) == 0


async def test_an_unexpected_error_ends_only_its_own_request(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug inside one request's send (here: an embedding whose memory cannot be read) ends
    that request with a 500 and a logged traceback; the service and other requests go on."""

    class BrokenMemory:
        address = 0
        nbytes = 0  # the ledger refuses an empty range with ValueError: not a RequestError
        rows = 0
        dim = 0
        dtype = "float32"
        checksum = "xxh3-64:0"
        segments = ((0, 0),)
        grids = (None,)
        image_lens = (0,)
        media = IMAGES

        def copy(self) -> BrokenMemory:
            return self

        def release(self) -> None:
            pass

    async with lifecycle_rig() as rig:

        async def broken() -> BrokenMemory:
            return BrokenMemory()

        await rig.open("bad", broken, receive_count=1)  # type: ignore[arg-type]
        encode, _ = rig.encoder("good", seed=7)
        await rig.open("good", encode, receive_count=1)
        a, b = await rig.landings(2)
        with caplog.at_level(logging.ERROR, logger="trio_encode"), pytest.raises(InternalError):
            await rig.registry.require_live("bad").send(a.receiver)
        assert any(r.exc_info for r in caplog.records), "the traceback is logged"
        report = await rig.registry.require_live("good").send(b.receiver)
        assert isinstance(report, SendReport)
        assert b.landed(NBYTES) == rig.expected["good"]
        await rig.assert_nothing_held()


async def test_a_failed_deregistration_keeps_the_memory_until_a_retry_succeeds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine refuses a deregistration with a code other than "not registered": the
    memory may still be registered, so it is quarantined (kept alive, counted) and the
    deregistration retried later, never freed under the engine."""
    async with lifecycle_rig() as rig:
        encode, alive = rig.encoder("r1", seed=9)
        await rig.open("r1", encode, receive_count=1)
        (a,) = await rig.landings(1)
        rig.sender.fail_next("deregister", TRANSFER_FAILED)
        await rig.registry.require_live("r1").send(a.receiver)
        await trio.testing.wait_all_tasks_blocked()
        assert len(rig.registry) == 0
        assert alive() is not None, "freed while the engine may still have it registered"
        assert rig.ledger.quarantined == 1
        assert len(rig.sender.live_registrations) == 1

        await rig.ledger.retry_quarantined()
        assert rig.ledger.quarantined == 0
        assert alive() is None
        await rig.assert_nothing_held()


async def test_a_deregistration_of_unknown_memory_is_not_quarantined(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """-3 means the engine holds no registration there: nothing to keep alive."""
    async with lifecycle_rig() as rig:
        encode, alive = rig.encoder("r1", seed=10)
        await rig.open("r1", encode, receive_count=1)
        (a,) = await rig.landings(1)
        rig.sender.fail_next("deregister", INVALID_ADDRESS)
        await rig.registry.require_live("r1").send(a.receiver)
        await trio.testing.wait_all_tasks_blocked()
        assert rig.ledger.quarantined == 0
        assert alive() is None


async def test_invalid_input_from_the_encoder_is_not_remembered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Bad input leaves nothing behind either (unchanged by the tombstone rework)."""
    async with lifecycle_rig() as rig:
        await rig.open_bad_input("bad")
        assert rig.registry.live("bad") is None


async def test_a_frozen_rank_parks_only_its_own_sends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A rank that stops answering holds at most ``sends_per_session`` transfer threads until
    Mooncake's timeout fails them; an unrelated request's transfer and release go on at once."""
    threads = ThreadSettings(transfer_threads=8, control_threads=2, sends_per_session=2)
    # Six waves of the engine's 30-s wait: the requests' deadline lies beyond the last.
    async with lifecycle_rig(threads=threads, send_timeout=300) as rig:
        frozen, healthy = await rig.landings(2)
        rig.fabric.freeze(frozen.engine.session_id)
        answers: list[object] = []

        async def stuck(i: int) -> None:
            encode, _ = rig.encoder(f"stuck{i}", seed=100 + i)
            await rig.open(f"stuck{i}", encode)
            try:
                answers.append(await rig.registry.require_live(f"stuck{i}").send(frozen.receiver))
            except EngineError as exc:
                answers.append(exc)

        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(stuck, i)
            await trio.sleep(1)
            into_frozen = [
                c for c in rig.sender.in_flight if c.session_id == frozen.engine.session_id
            ]
            assert len(into_frozen) == threads.sends_per_session

            began = trio.current_time()
            encode, alive = rig.encoder("other", seed=7)
            await rig.open("other", encode)
            other = rig.registry.require_live("other")
            await other.send(healthy.receiver)
            await other.wait_ended()
            assert trio.current_time() - began < 1, "the unrelated request waited"
            assert healthy.landed(NBYTES) == rig.expected["other"]
            assert alive() is None
        # Each frozen send failed after the timeout, a pool's worth at a time, with -1.
        assert len(answers) == 12
        assert all(isinstance(a, EngineError) and a.code == TRANSFER_FAILED for a in answers)
        await trio.sleep_until(300)  # the stuck requests expire
        await rig.assert_nothing_held()


async def test_a_frozen_node_leaves_the_threads_another_node_needs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A TP=4 node whose ranks all stop answering holds at most ``sends_per_host`` transfer
    threads (not ``sends_per_session`` per rank, which would take them all); a send to another
    node goes at once."""
    threads = ThreadSettings(
        transfer_threads=8, control_threads=2, sends_per_session=2, sends_per_host=4
    )
    async with lifecycle_rig(threads=threads) as rig:
        node = [await rig.landing(name="node-a") for _ in range(4)]
        healthy = await rig.landing(name="node-b")
        for rank in node:
            rig.fabric.freeze(rank.engine.session_id)

        async def stuck(i: int) -> None:
            encode, _ = rig.encoder(f"stuck{i}", seed=100 + i)
            await rig.open(f"stuck{i}", encode)
            with pytest.raises(EngineError):
                await rig.registry.require_live(f"stuck{i}").send(node[i % 4].receiver)

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(stuck, i)
            await trio.sleep(1)
            frozen = {rank.engine.session_id for rank in node}
            into_node = [c for c in rig.sender.in_flight if c.session_id in frozen]
            assert len(into_node) == threads.sends_per_host
            # the rest queue behind their own rank's bound, then behind the node's
            assert rig.sender.threads.host_sends_in_flight("node-a") == 4 * 2

            began = trio.current_time()
            encode, _ = rig.encoder("other", seed=7)
            await rig.open("other", encode)
            await rig.registry.require_live("other").send(healthy.receiver)
            assert trio.current_time() - began < 1, "the other node's send waited"
            assert healthy.landed(NBYTES) == rig.expected["other"]
        await trio.sleep(180)  # the stuck requests' backstops
        await rig.assert_nothing_held()
        assert rig.sender.threads.bounds_held == 0, "a receiver's bound outlived its sends"


async def test_releases_never_wait_behind_transfers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With every transfer thread busy, a scope that ends still deregisters at once: control
    calls have their own threads."""
    threads = ThreadSettings(transfer_threads=2, control_threads=1, sends_per_session=2)
    async with lifecycle_rig(send_timeout=10, threads=threads) as rig:
        a, b = await rig.landings(2)
        gate = rig.sender.gate("transfer")
        try:
            async with trio.open_nursery() as nursery:
                for i, landing in enumerate((a, b)):
                    encode, _ = rig.encoder(f"busy{i}", seed=i)
                    await rig.open(f"busy{i}", encode)
                    nursery.start_soon(rig.registry.require_live(f"busy{i}").send, landing.receiver)
                await gate.wait_arrivals(2)
                # A third request leases its memory, then its backstop fires before it can
                # get a transfer thread: it must still release at once.
                encode, alive = rig.encoder("ending", seed=3)
                await rig.open("ending", encode)
                ending = rig.registry.require_live("ending")

                async def cut_short() -> None:
                    with pytest.raises(ShuttingDown):
                        await ending.send(a.receiver)

                nursery.start_soon(cut_short)
                await trio.testing.wait_all_tasks_blocked()
                assert rig.ledger.live_registrations == 3
                ending.cancel()
                with trio.fail_after(0.001):
                    await ending.wait_ended()
                assert rig.sender.count("deregister", ok=True) == 1
                assert alive() is None
                gate.open()
        finally:
            gate.open()


async def test_a_served_receiver_that_retries_after_completion_gets_its_answer_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A rank whose 200 was lost retries after the request completed: it gets the same answer,
    marked as a repeat, and no bytes move; a receiver that was never served still gets 410."""
    async with lifecycle_rig() as rig:
        encode, _ = rig.encoder("r1", seed=21)
        await rig.open("r1", encode, receive_count=2)
        a, b, stranger = await rig.landings(3)
        scope = rig.registry.require_live("r1")
        first = await scope.send(a.receiver)
        again_while_live = await scope.send(a.receiver)
        assert again_while_live.repeat
        assert not first.repeat
        await scope.send(b.receiver)
        await scope.wait_ended()
        transfers = rig.sender.count("transfer")

        repeat = rig.registry.answer("send", "r1", receiver=a.receiver)
        assert repeat is not None
        assert repeat.repeat
        assert repeat.shape == first.shape
        assert (repeat.receivers_done, repeat.receive_count) == (2, 2)
        with pytest.raises(RequestReleased):
            rig.registry.answer("send", "r1", receiver=stranger.receiver)
        with pytest.raises(RequestReleased):
            rig.registry.require_live("r1")
        assert rig.sender.count("transfer") == transfers
        await rig.assert_nothing_held()


async def test_every_answer_carries_the_checksum_of_the_bytes_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The checksum in the answers is that of the bytes that landed."""
    async with lifecycle_rig() as rig:
        embedding = make_embedding(5)
        expected = checksum_of(embedding.tensor.numpy().tobytes())
        encode, _ = rig.encoder("r1", embedding)
        del embedding
        await rig.open("r1", encode)
        (a,) = await rig.landings(1)
        scope = rig.registry.require_live("r1")
        shape = await scope.wait_encoded()
        report = await scope.send(a.receiver)
        assert shape.checksum == report.shape.checksum == expected
        assert checksum_of(a.landed(NBYTES)) == expected
