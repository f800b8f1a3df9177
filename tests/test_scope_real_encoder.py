"""The lifecycle stories again, with the real encoder in the loop (a tiny built-in ViT).

The encoder's batching and cache are what make memory shared between requests (a cache hit
hands out one tensor; a batch hands out views into one output), so invariant 1 is checked here
against what the encoder really produces. On the mock clock: the encoder's "worker thread" runs
its real forward inline after a shielded virtual-time sleep, which is how a thread behaves
(it cannot be cancelled) without putting a real thread under the mock clock.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TypeVar

import pytest
import torch
import trio
import trio.testing

from support.models import fixed
from trio_encode.encoder import EncoderSettings, ImageEncoder, decode_image, load_backend
from trio_encode.encoder.images import load_item
from trio_encode.errors import EncodeFailed, RequestReleased, ScopeExpired
from trio_encode.request_types import Receiver
from trio_encode.service import EncodeService, ServiceSettings
from trio_encode.testing.images import noise_uri
from trio_encode.testing.memory_engine import InMemoryEngine, InMemoryFabric

T = TypeVar("T")
FORWARD_SECONDS = 0.5
TINY = EncoderSettings(
    image_size=32,
    patch_size=16,
    width=32,
    depth=1,
    heads=2,
    hidden_size=64,
    max_batch_size=4,
    max_batch_wait=0.01,
    queue_size=16,
    warmup=False,
)


class ForwardGate:
    """Holds the encoder's forward "thread" at its start, like a stuck GPU kernel."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.event.set()

    def hold(self) -> None:
        self.event = trio.Event()

    def release(self) -> None:
        self.event.set()


@dataclass
class Harness:
    service: EncodeService
    encoder: ImageEncoder
    sender: InMemoryEngine
    fabric: InMemoryFabric
    forward_gate: ForwardGate
    forwards: list[int] = field(default_factory=list)
    buffers: list[ctypes.Array[ctypes.c_char]] = field(default_factory=list)

    async def receiver(self, nbytes: int = 64 * 1024) -> tuple[Receiver, Callable[[int], bytes]]:
        """A rank with its own engine and a registered landing buffer; returns a reader."""
        engine = self.fabric.engine()
        buffer = (ctypes.c_char * nbytes)()
        self.buffers.append(buffer)
        await engine.register(ctypes.addressof(buffer), nbytes)
        return Receiver(engine.session_id, ctypes.addressof(buffer)), lambda n: bytes(buffer[:n])

    def expected(self, uri: str) -> bytes:
        """The embedding of one image computed directly by the model (no batching)."""
        data = load_item(uri, max_bytes=TINY.max_image_bytes)
        backend = self.encoder.backend
        pixels = decode_image(data, backend.preprocess, max_pixels=TINY.max_image_pixels)
        with torch.inference_mode():
            row = backend.forward(pixels.unsqueeze(0))[0].contiguous()
        return bytes(row.view(torch.uint8).flatten().numpy().tobytes())

    async def settled(self) -> None:
        await trio.testing.wait_all_tasks_blocked()
        assert len(self.service.registry) == 0
        assert self.service.ledger.live_registrations == 0
        assert self.sender.live_registrations == {}
        assert self.fabric.violations == []
        assert not any(call.code not in (0, None) for call in self.sender.calls("register"))


@asynccontextmanager
async def real_encoder(
    *, cache_bytes: int = 0, send_timeout: float = 180.0
) -> AsyncIterator[Harness]:
    settings = replace(TINY, cache_bytes=cache_bytes)
    backend = fixed(load_backend(settings))
    gate = ForwardGate()
    forwards: list[int] = []

    async def inline_thread(fn: Callable[[], T]) -> T:
        with trio.CancelScope(shield=True):  # a started thread runs to its end
            await gate.event.wait()
            await trio.sleep(FORWARD_SECONDS)
        return fn()

    async def inline_decode(fn: Callable[[], T]) -> T:
        await trio.lowlevel.checkpoint()
        return fn()

    original_forward = backend.forward

    def counting_forward(pixels: torch.Tensor) -> torch.Tensor:
        forwards.append(int(pixels.shape[0]))
        return original_forward(pixels)

    backend.forward = counting_forward  # type: ignore[method-assign]
    encoder = ImageEncoder(backend, settings, run_decode=inline_decode, run_forward=inline_thread)
    fabric = InMemoryFabric()
    sender = fabric.engine("encoder")
    with trio.fail_after(3600):
        async with EncodeService.running(
            engine=sender,
            encoder=encoder,
            settings=ServiceSettings(send_timeout=send_timeout, shutdown_grace=0),
        ) as service:
            yield Harness(service, encoder, sender, fabric, gate, forwards)


async def test_tp_siblings_register_the_encoders_output_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with real_encoder() as h:
        uri = noise_uri(1)
        ranks = [await h.receiver() for _ in range(4)]

        async def rank(receiver: Receiver) -> None:
            await h.service.encode("r1", [uri], receive_count=4)
            await h.service.send("r1", receiver)

        async with trio.open_nursery() as nursery:
            for receiver, _ in ranks:
                nursery.start_soon(rank, receiver)
        assert h.forwards == [1]  # one encoder run for four siblings
        expected = h.expected(uri)
        assert all(read(len(expected)) == expected for _, read in ranks)
        assert h.sender.count("register") == 1
        await h.settled()


async def test_cache_hit_shares_memory_and_one_registration(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 1: the second request is a cache hit on the same image, so both embeddings
    are the same tensor; while the first still sends, the second leases its registration."""
    async with real_encoder(cache_bytes=1 << 20) as h:
        uri = noise_uri(2)
        (ra, read_a), (rb, read_b) = await h.receiver(), await h.receiver()
        await h.service.encode("a", [uri], receive_count=1)
        await h.service.encode("b", [uri], receive_count=1)
        assert h.forwards == [1]  # b came from the cache
        gate = h.sender.gate("transfer")
        async with trio.open_nursery() as nursery:
            try:
                nursery.start_soon(h.service.send, "a", ra)
                await gate.wait_arrivals(1)
                nursery.start_soon(h.service.send, "b", rb)
                with trio.fail_after(60):
                    await gate.wait_arrivals(2)
                assert h.service.ledger.regions()[0][2] == 2  # one region, two leases
                assert h.sender.count("register") == 1
            finally:
                gate.open()
        expected = h.expected(uri)
        assert read_a(len(expected)) == read_b(len(expected)) == expected
        await h.settled()


async def test_views_into_one_batch_are_registered_apart_without_overlap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Invariant 1: four requests encoded in one forward get views into one output tensor;
    each view is its own non-overlapping registration, and every byte is right."""
    async with real_encoder() as h:
        uris = [noise_uri(10 + i) for i in range(4)]
        receivers = [await h.receiver() for _ in uris]
        async with trio.open_nursery() as nursery:
            for i, uri in enumerate(uris):
                nursery.start_soon(partial(h.service.encode, f"r{i}", [uri], receive_count=1))
        assert h.forwards == [4]
        gate = h.sender.gate("transfer")
        async with trio.open_nursery() as nursery:
            try:
                for i, (receiver, _) in enumerate(receivers):
                    nursery.start_soon(h.service.send, f"r{i}", receiver)
                with trio.fail_after(60):
                    await gate.wait_arrivals(4)
                regions = sorted(h.service.ledger.regions())
                assert len(regions) == 4
                for (start, length, _), (next_start, _, _) in itertools.pairwise(regions):
                    assert start + length <= next_start
            finally:
                gate.open()
        for uri, (_, read) in zip(uris, receivers, strict=True):
            expected = h.expected(uri)
            assert read(len(expected)) == expected
        await h.settled()


async def test_request_cancelled_in_the_encoder_queue_is_never_encoded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Story 9: the forward is stuck; a request queued behind it hits its backstop, leaves
    the queue, is never encoded, and leaves nothing behind."""
    async with real_encoder(send_timeout=30) as h:
        receiver, _ = await h.receiver()
        outcomes: dict[str, object] = {}

        async def encode(req_id: str, uri: str) -> None:
            try:
                outcomes[req_id] = await h.service.encode(req_id, [uri], receive_count=1)
            except Exception as exc:
                outcomes[req_id] = exc

        h.forward_gate.hold()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(encode, "busy", noise_uri(20))
                await trio.sleep(1.0)  # "busy" is in the (stuck) forward now
                nursery.start_soon(encode, "queued", noise_uri(21))
                await trio.testing.wait_all_tasks_blocked()
                assert h.encoder.queued_images == 1
        finally:
            h.forward_gate.release()
        assert isinstance(outcomes["queued"], ScopeExpired)
        assert isinstance(outcomes["busy"], ScopeExpired)
        assert h.encoder.queued_images == 0
        await trio.sleep(FORWARD_SECONDS * 2)
        assert h.forwards == [1]  # the stuck batch ran; the queued request never did
        with pytest.raises(RequestReleased):  # a late /send cannot resurrect it
            await h.service.send("queued", receiver)
        await h.settled()


async def test_model_failure_reaches_every_sibling(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with real_encoder() as h:

        def broken(pixels: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")

        h.encoder.backend.forward = broken  # type: ignore[method-assign]
        outcomes: list[object] = []

        async def rank() -> None:
            try:
                await h.service.encode("r1", [noise_uri(3)], receive_count=2)
            except Exception as exc:
                outcomes.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rank)
            nursery.start_soon(rank)
        assert len(outcomes) == 2
        assert all(isinstance(o, EncodeFailed) for o in outcomes)
        assert all("CUBLAS_STATUS_EXECUTION_FAILED" in str(o) for o in outcomes)
        await h.settled()
