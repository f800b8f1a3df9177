"""A test rig for request scopes on the in-memory engine and Trio's mock clock.

It builds what the service builds (ledger, registry, service nursery) around an in-memory
sender engine, plus receivers that own their own in-memory engine and registered landing
buffer, and encoders whose latency and failures the test scripts. Embeddings are handed to the
scope without the rig keeping a strong reference, so a test can watch (through a weakref) the
moment the scope drops one.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import torch
import trio
import trio.testing

from trio_encode.embedding import Embedding
from trio_encode.engine.threads import ThreadSettings
from trio_encode.errors import EncodeFailed, InvalidInput
from trio_encode.ledger import RegistrationLedger
from trio_encode.request_types import EmbeddingMemory, Receiver
from trio_encode.scope import RequestScope
from trio_encode.scopes import ScopeRegistry
from trio_encode.testing.memory_engine import InMemoryEngine, InMemoryFabric


class RecordingObserver:
    """Records every lifecycle event as ``(name, args...)`` with the virtual time."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, tuple[object, ...]]] = []
        self.scope_seconds: dict[str, float] = {}
        """How long each closed scope lived, as it reported when it closed."""

    def _add(self, name: str, *args: object) -> None:
        self.events.append((trio.current_time(), name, args))

    def names(self, name: str) -> list[tuple[object, ...]]:
        return [args for _, event, args in self.events if event == name]

    def scope_opened(self, req_id: str) -> None:
        self._add("scope_opened", req_id)

    def scope_closed(self, req_id: str, reason: str, seconds: float) -> None:
        self._add("scope_closed", req_id, reason)
        self.scope_seconds[req_id] = seconds

    def registered(self, address: int, length: int) -> None:
        self._add("registered", address, length)

    def deregistered(self, address: int) -> None:
        self._add("deregistered", address)

    def registration_timed(self, call: str, seconds: float) -> None:
        self._add("registration_timed", call, seconds)

    def transfer_finished(self, req_id: str, nbytes: int, seconds: float) -> None:
        self._add("transfer_finished", req_id, nbytes, seconds)

    def engine_error(self, call: str, code: int) -> None:
        self._add("engine_error", call, code)

    def backstop_expired(self, req_id: str) -> None:
        self._add("backstop_expired", req_id)

    def split_expired(self, req_id: str, served: int, receive_count: int) -> None:
        self._add("split_expired", req_id, served, receive_count)

    def quarantine_changed(self, regions: int, nbytes: int) -> None:
        self._add("quarantine_changed", regions, nbytes)

    def completion_pushed(self, kind: str, *, ok: bool) -> None:
        self._add("completion_pushed", kind, ok)

    def transfer_hold_overdue(self, nbytes: int) -> None:
        self._add("transfer_hold_overdue", nbytes)


def make_embedding(seed: int, rows: int = 64, dim: int = 32) -> Embedding:
    """A float32 embedding whose bytes depend on ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return Embedding(torch.randn(rows, dim, generator=generator))


class SeededEncoder:
    """A service's encoder for mock-clock tests: no threads and no arena (per-request
    registration); ``img:`` items load at once, a forward takes 1 s of virtual time, and the
    embedding is seeded by the images' bytes. Tests override what they steer."""

    ready = True
    arena = None

    async def load_items(self, items: Sequence[str], modality: str = "IMAGE") -> list[bytes]:
        if any(not item.startswith("img:") for item in items):
            raise InvalidInput("not an image")
        return [item.encode() for item in items]

    async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> Embedding:
        await trio.sleep(1.0)
        return make_embedding(len(b"".join(images)))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()


@dataclass
class Landing:
    """A receiver: its own engine and a registered, zero-filled landing buffer."""

    engine: InMemoryEngine
    buffer: torch.Tensor

    @property
    def receiver(self) -> Receiver:
        return Receiver(self.engine.session_id, int(self.buffer.data_ptr()))

    def landed(self, nbytes: int | None = None) -> bytes:
        """The first ``nbytes`` of the buffer (all of it by default)."""
        return bytes(self.buffer[:nbytes].numpy().tobytes())


async def landing_on(fabric: InMemoryFabric, name: str | None, nbytes: int = 1 << 16) -> Landing:
    """A receiver on ``fabric``: an engine named ``name`` and a zeroed, registered buffer."""
    engine = fabric.engine(name)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    await engine.register(int(buffer.data_ptr()), nbytes)
    return Landing(engine, buffer)


@dataclass
class EncoderScript:
    """An encode callable for one request and what happened to it."""

    latency: float = 0.0
    error: Exception | None = None
    gate: trio.Event | None = None
    started: int = 0
    cancelled: bool = False
    _box: list[EmbeddingMemory] = field(default_factory=list)

    async def __call__(self) -> EmbeddingMemory:
        self.started += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            await trio.sleep(self.latency)
        except trio.Cancelled:
            self.cancelled = True
            self._box.clear()  # a cancelled encoder run produces nothing
            raise
        if self.error is not None:
            raise self.error
        # Hand over the only strong reference: the scope owns the embedding from here.
        return self._box.pop()


@dataclass
class Rig:
    fabric: InMemoryFabric
    sender: InMemoryEngine
    ledger: RegistrationLedger
    registry: ScopeRegistry
    observer: RecordingObserver
    nursery: trio.Nursery
    expected: dict[str, bytes] = field(default_factory=dict)

    async def landing(self, nbytes: int = 64 * 32 * 4, name: str | None = None) -> Landing:
        return await landing_on(self.fabric, name, nbytes)

    async def landings(self, count: int, nbytes: int = 64 * 32 * 4) -> list[Landing]:
        return [await self.landing(nbytes, name=f"rank{i}") for i in range(count)]

    def encoder(
        self,
        req_id: str,
        embedding: Embedding | None = None,
        *,
        seed: int = 0,
        latency: float = 0.0,
        error: Exception | None = None,
    ) -> tuple[EncoderScript, weakref.ref[Embedding]]:
        """An encode callable handing over ``embedding`` (or a fresh one from ``seed``); the
        bytes every receiver should end up with are kept in :attr:`expected`."""
        if embedding is None:
            embedding = make_embedding(seed)
        self.expected[req_id] = bytes(embedding.tensor.numpy().tobytes())
        script = EncoderScript(latency=latency, error=error)
        script._box.append(embedding)
        return script, weakref.ref(embedding)

    async def open(
        self,
        req_id: str,
        encode: Callable[[], Awaitable[EmbeddingMemory]],
        receive_count: int = 1,
    ) -> None:
        await self.registry.open(req_id, receive_count=receive_count, encode=encode)

    def failing_encoder(self, message: str = "CUDA out of memory") -> EncoderScript:
        return EncoderScript(error=EncodeFailed(message))

    async def open_bad_input(self, req_id: str) -> None:
        """Open ``req_id`` with an encoder that finds its input bad; the scope raises that
        :class:`InvalidInput`, and every task settles."""
        bad = self.failing_encoder()
        bad.error = InvalidInput("not an image")
        await self.open(req_id, bad)
        with pytest.raises(InvalidInput):
            await self.registry.require_live(req_id).wait_encoded()
        await trio.testing.wait_all_tasks_blocked()

    async def assert_completed(self, scope: RequestScope) -> None:
        """``scope`` ends because every receiver got its copy; then nothing is left held."""
        await scope.wait_ended()
        assert scope.end_reason == "completed"
        await self.assert_nothing_held()

    async def assert_nothing_held(self) -> None:
        """Invariant 8: once every task has settled, no scope, registration or violation is
        left."""
        await trio.testing.wait_all_tasks_blocked()
        assert len(self.registry) == 0
        assert self.ledger.live_registrations == 0
        assert self.sender.live_registrations == {}
        assert self.fabric.violations == []
        assert self.sender.count("register") == self.sender.count("deregister", ok=True) + (
            self.sender.count("register", ok=False)
        )


@asynccontextmanager
async def lifecycle_rig(
    send_timeout: float = 180.0,
    *,
    register_latency: float = 0.0,
    transfer_latency: float = 0.0,
    threads: ThreadSettings | None = None,
    transfer_timeout: float = 30.0,
    progress_timeout: float | None = None,
    overdue_after: float = 600.0,
) -> AsyncIterator[Rig]:
    """A registry with its service nursery, over an in-memory sender engine. With a
    ``progress_timeout`` (transfers into a frozen peer outlive their caller's wait) the ledger's
    task runs too, as in the service, to release what it holds for them."""
    fabric = InMemoryFabric(transfer_timeout=transfer_timeout, progress_timeout=progress_timeout)
    sender = fabric.engine(
        "encoder",
        register_latency=register_latency,
        transfer_latency=transfer_latency,
        threads=threads,
    )
    observer = RecordingObserver()
    ledger = RegistrationLedger(sender, observer, overdue_after=overdue_after)
    # Every test gets a virtual hour: on the mock clock a deadlock jumps here and fails fast.
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            if progress_timeout is not None:
                await nursery.start(ledger.run)
            registry = ScopeRegistry(
                nursery,
                engine=sender,
                ledger=ledger,
                send_timeout=send_timeout,
                observer=observer,
            )
            yield Rig(fabric, sender, ledger, registry, observer, nursery)
            nursery.cancel_scope.cancel()


async def gather_sends(rig: Rig, req_id: str, receivers: list[Receiver]) -> list[object]:
    """Send to every receiver concurrently, as TP siblings do; each result or error."""
    results: list[object] = [None] * len(receivers)

    async def one(i: int, receiver: Receiver) -> None:
        try:
            results[i] = await rig.registry.require_live(req_id).send(receiver)
        except Exception as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        for i, receiver in enumerate(receivers):
            nursery.start_soon(one, i, receiver)
    return results
