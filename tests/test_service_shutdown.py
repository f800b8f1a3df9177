"""Service-level lifecycle on the mock clock: shutdown lets scopes finish, then cuts them."""

from __future__ import annotations

import ctypes
import gc
import weakref
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from support.lifecycle_rig import SeededEncoder
from trio_encode.embedding import Embedding
from trio_encode.errors import ShuttingDown
from trio_encode.request_types import Receiver
from trio_encode.service import EncodeService, ServiceSettings
from trio_encode.testing.memory_engine import InMemoryFabric


async def test_shutdown_finishes_what_it_can_and_cuts_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fabric = InMemoryFabric()
    sender = fabric.engine("encoder", transfer_latency=4.0)
    rank = fabric.engine("rank0")
    landing = bytearray(64 * 32 * 4 * 2)
    import ctypes

    buffer = (ctypes.c_char * len(landing)).from_buffer(landing)
    address = ctypes.addressof(buffer)
    await rank.register(address, len(landing))
    receiver = Receiver(rank.session_id, address)
    settings = ServiceSettings(send_timeout=180, shutdown_grace=10)
    answers: dict[str, object] = {}

    async def send(req_id: str, service: EncodeService) -> None:
        try:
            answers[req_id] = await service.send(req_id, receiver)
        except Exception as exc:
            answers[req_id] = exc

    encoder = WatchedSeededEncoder()
    async with trio.open_nursery() as outer:
        async with EncodeService.running(
            engine=sender, encoder=encoder, settings=settings
        ) as service:
            # "finishing": its one receiver is mid-transfer when shutdown starts.
            await service.encode("finishing", ["img:a"], receive_count=1)
            # "waiting": one of two receivers sent; the other never will.
            await service.encode("waiting", ["img:b"], receive_count=2)
            outer.start_soon(send, "finishing", service)
            await trio.testing.wait_all_tasks_blocked()
            assert len(sender.in_flight) == 1
            report_task_started = trio.current_time()
            report = await service.shutdown()
            # New requests are refused while shutting down.
            try:
                await service.encode("late", ["img:c"], receive_count=1)
            except ShuttingDown:
                refused = True
            else:
                refused = False

        assert refused
        assert (report.finished, report.cut_short) == (1, 1)
        assert trio.current_time() - report_task_started == 10  # the grace, then the cut
        assert not isinstance(answers["finishing"], Exception)
        assert service.ledger.live_registrations == 0
        assert sender.live_registrations == {}
        assert len(service.registry) == 0
        assert fabric.violations == []
    del buffer


async def test_a_second_signal_cuts_the_grace_short() -> None:
    """SIGTERM starts a graceful shutdown with a 30 s grace; a second signal (an impatient
    Ctrl-C) ends it at once, without a traceback, and every registration is released."""
    import os
    import signal
    from functools import partial

    from trio_encode.client import EncodeClient
    from trio_encode.server.serve import serve
    from trio_encode.settings import ServerSettings
    from trio_encode.testing.images import image_uri
    from trio_encode.testing.stand_in_encoder import StandInEncoder

    fabric = InMemoryFabric()
    settings = ServerSettings(port=0, shutdown_grace=30.0)
    async with trio.open_nursery() as nursery:
        running = await nursery.start(
            partial(
                serve,
                settings,
                engine=fabric.engine("encoder"),
                encoder=StandInEncoder(),
                handle_signals=True,
            )
        )
        async with EncodeClient(running.url) as client:
            await client.encode("waits", [image_uri(b"x")], receive_count=2)
        began = trio.current_time()
        os.kill(os.getpid(), signal.SIGTERM)
        with trio.fail_after(5):
            while not running.service.registry.closed:  # noqa: ASYNC110
                await trio.sleep(0.01)
        await trio.sleep(0.2)
        assert len(running.service.registry) == 1  # still in its grace
        os.kill(os.getpid(), signal.SIGINT)
    assert trio.current_time() - began < 10  # the grace is 30 s: cut short, even on a busy machine
    report = running.service.shutdown_report
    assert report is not None
    assert report.cut_short == 1
    assert running.service.ledger.live_registrations == 0


class WatchedSeededEncoder(SeededEncoder):
    """Keeps a weak reference to every embedding it hands out."""

    def __init__(self) -> None:
        self.embeddings: list[weakref.ref[Embedding]] = []

    async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> Embedding:
        embedding = await super().encode(images)
        self.embeddings.append(weakref.ref(embedding))
        return embedding


@pytest.mark.parametrize("progress", [10.0, 1000.0])
async def test_shutdown_waits_for_held_transfers_and_keeps_what_is_still_read(
    autojump_clock: trio.testing.MockClock, progress: float
) -> None:
    """A rank froze mid-transfer when the server shuts down: the cut-short send stops waiting
    at once, and shutdown then waits (at most send_timeout) for Mooncake to end the transfer.
    One that ends in time is released as usual; one that does not is kept registered and
    allocated until exit, counted in the report, and never deregistered under Mooncake."""
    fabric = InMemoryFabric(transfer_timeout=60.0, progress_timeout=progress)
    sender = fabric.engine("encoder")
    rank = fabric.engine("rank0")
    landing = bytearray(64 * 32 * 4 * 2)
    buffer = (ctypes.c_char * len(landing)).from_buffer(landing)
    await rank.register(ctypes.addressof(buffer), len(landing))
    receiver = Receiver(rank.session_id, ctypes.addressof(buffer))
    settings = ServiceSettings(send_timeout=20, shutdown_grace=1)
    answers: list[object] = []

    async def send(service: EncodeService) -> None:
        try:
            answers.append(await service.send("r1", receiver))
        except Exception as exc:
            answers.append(type(exc))  # its traceback would keep the service alive

    encoder = WatchedSeededEncoder()
    async with trio.open_nursery() as outer:
        async with EncodeService.running(
            engine=sender, encoder=encoder, settings=settings
        ) as service:
            await service.encode("r1", ["img:a"], receive_count=1)
            fabric.freeze(rank.session_id)
            outer.start_soon(send, service)
            await trio.sleep(2.0)
        report = service.shutdown_report
        assert report is not None
        await trio.testing.wait_all_tasks_blocked()
        assert answers == [ShuttingDown]
        if progress < settings.send_timeout:
            # The transfer started at 1 s (after the encode): Mooncake fails it at 1 + progress.
            assert trio.current_time() == pytest.approx(1.0 + progress)  # waited for its end
            assert report.held_bytes == 0
            assert sender.live_registrations == {}
        else:
            # Cut short at 4 s (3 s, then the 1-s grace); then the bound on the wait.
            assert trio.current_time() == pytest.approx(4.0 + settings.send_timeout)
            assert report.held_bytes > 0
            assert len(sender.live_registrations) == 1, "deregistered under Mooncake"
            del service
            gc.collect()
            assert encoder.embeddings[0]() is not None, "freed while Mooncake may read it"
            fabric.thaw(rank.session_id)  # the transfer reads its source now
        assert fabric.violations == []
