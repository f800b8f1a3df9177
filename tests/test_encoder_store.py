"""The store level's promises that need no master: keys that cannot collide across models, a
bounded wait on a slow store, puts that never block, and every outcome counted."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
import torch
import trio
import xxhash

from support.fake_encoder import SETTINGS, Fingerprinted, encoder_running, image, inline
from trio_encode.arena import Arena
from trio_encode.embedding import ArenaEmbedding, tensor_checksum
from trio_encode.encoder import CacheKey, ImageEncoder
from trio_encode.encoder.cache import content_key
from trio_encode.encoder.model import BuiltinBackend
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.encoder.store import (
    MooncakeEmbeddingStore,
    StoreHit,
    _body,
    _describe,
    _digest_bytes,
    store_key,
)

TINY = EncoderSettings(
    image_size=32, patch_size=16, width=32, heads=2, depth=1, hidden_size=64, warmup=False
)


def test_the_fingerprint_changes_with_kind_config_dtype_and_weights_only() -> None:
    base = BuiltinBackend(TINY).fingerprint
    assert BuiltinBackend(TINY).fingerprint == base  # same model, same fingerprint
    for changed in (
        replace(TINY, dtype="bfloat16"),
        replace(TINY, seed=1),  # other weights
        replace(TINY, hidden_size=32),
        replace(TINY, depth=2),
    ):
        assert BuiltinBackend(changed).fingerprint != base, changed
    # Settings that do not shape the forward do not split the cache.
    assert BuiltinBackend(replace(TINY, max_batch_size=2, cache_bytes=0)).fingerprint == base
    key = CacheKey("any", "ab" * 32)
    assert store_key(base, key) != store_key(BuiltinBackend(replace(TINY, seed=1)).fingerprint, key)


class Events:
    def __init__(self) -> None:
        self.lookups: list[tuple[str, int]] = []
        self.puts: list[str] = []

    def store_connected(self, connected: bool) -> None:
        pass

    def store_looked_up(self, result: str, images: int) -> None:
        self.lookups.append((result, images))

    def store_put(self, result: str) -> None:
        self.puts.append(result)


class PerKey:
    """The store client's two batched calls (a digest, a description and a row per key), over
    the one call per key and row a fake answers; a row found gets the digest of its bytes and
    an empty description made for it."""

    def get_into(self, key: str, address: int, nbytes: int) -> int:
        raise NotImplementedError

    def put_from(self, key: str, address: int, nbytes: int) -> int:
        raise NotImplementedError

    def batch_get_into_multi_buffers(
        self, keys: list[str], pointers: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        codes = []
        for key, (digest_at, header_at, row_at), (digest_bytes, header_bytes, row_bytes) in zip(
            keys, pointers, sizes, strict=True
        ):
            code = self.get_into(key, row_at, row_bytes)
            if code == row_bytes:
                digest = xxhash.xxh3_64_digest(ctypes.string_at(row_at, row_bytes))
                body = _body(None, ())
                assert body is not None
                header = _describe(None, key, digest, body)
                assert len(header) == header_bytes
                ctypes.memmove(digest_at, digest, digest_bytes)
                ctypes.memmove(header_at, header, header_bytes)
                code += digest_bytes + header_bytes
            codes.append(code)
        return codes

    def batch_put_from_multi_buffers(
        self, keys: list[str], pointers: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        return [
            self.put_from(key, row_at, row_bytes)
            for key, (_, _, row_at), (_, _, row_bytes) in zip(keys, pointers, sizes, strict=True)
        ]

    def remove(self, key: str, force: bool = False) -> int:
        return 0


def offer(store: MooncakeEmbeddingStore, key: str, tensor: torch.Tensor) -> None:
    store.put(key, tensor, tensor_checksum(tensor))


class HungClient(PerKey):
    """A store client whose calls block until released (a master that stopped answering)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written = threading.Event()

    def get_into(self, key: str, address: int, nbytes: int) -> int:
        self.release.wait(10)
        ctypes.memset(address, 1, nbytes)  # the late read still writes its buffer
        if key == "k2":
            self.written.set()
        return nbytes

    def put_from(self, key: str, address: int, nbytes: int) -> int:
        self.release.wait(10)
        return 0


def _store(events: Events, wait: float = 0.05) -> MooncakeEmbeddingStore:
    return MooncakeEmbeddingStore(
        master="127.0.0.1:1", segment_bytes=1 << 20, buffer_bytes=1 << 20, wait=wait,
        observer=events,
    )  # fmt: skip


async def test_a_slow_store_costs_a_request_at_most_the_bounded_wait() -> None:
    events = Events()
    store = _store(events)
    client = HungClient()
    store._client = client
    into = [torch.zeros(16, 4), torch.zeros(16, 4)]
    started = time.monotonic()
    found = await store.get(["k1", "k2"], into)
    elapsed = time.monotonic() - started
    assert found == [None, None]
    assert elapsed < 0.5
    assert events.lookups == [("timeout", 2)]
    # The abandoned read finishes later, writing only the buffers it was given (kept alive
    # by its own reference); the caller has dropped them.
    client.release.set()
    assert await trio.to_thread.run_sync(client.written.wait, 5)
    assert bool((into[1].view(torch.uint8) == 1).all())


async def test_results_are_counted_per_image() -> None:
    class Answers(PerKey):
        def get_into(self, key: str, address: int, nbytes: int) -> int:
            return {"hit": nbytes, "miss": -704}.get(key, -900)

    events = Events()
    store = _store(events, wait=5.0)
    store._client = Answers()
    found = await store.get(["hit", "miss", "broken"], [torch.zeros(4) for _ in range(3)])
    assert found == [StoreHit(tensor_checksum(torch.zeros(4))), None, None]
    assert events.lookups == [("hit", 1), ("miss", 1), ("error", 1)]


async def test_without_a_connection_lookups_and_puts_return_at_once() -> None:
    events = Events()
    store = _store(events)
    assert await store.get(["k"], [torch.zeros(4)]) == [None]
    offer(store, "k", torch.zeros(4))
    assert events.lookups == [("unavailable", 1)]
    assert events.puts == ["dropped"]


async def test_puts_never_block_a_full_queue_drops() -> None:
    events = Events()
    store = _store(events)
    store._client = HungClient()
    for n in range(100):
        offer(store, f"k{n}", torch.zeros(4))  # no await: never blocks the forward's loop
    assert events.puts == ["dropped"] * (100 - 64)


def test_store_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        EncoderSettings(store_master="localhost")
    with pytest.raises(ValueError, match="store_wait"):
        EncoderSettings(store_wait=0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        EncoderSettings(store_master="etcd://a:1;b")
    for address in ("10.0.0.1:50051", "etcd://10.0.0.1:2379;10.0.0.2:2379"):
        assert EncoderSettings(store_master=address).store_master == address


class FakeStoreClient(HungClient):
    """Connects at once; ``close`` is recorded. Reads hang until released."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = threading.Event()

    def setup(self, *args: object) -> int:
        return 0

    def close(self) -> None:
        self.closed.set()


async def test_the_client_is_closed_only_when_no_call_still_uses_it() -> None:
    for hung in (False, True):
        events = Events()
        store = _store(events)
        client = FakeStoreClient()
        store._store_class = lambda client=client: client
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            while True:  # setup() runs in a thread: poll for it
                if store.connected:
                    break
                await trio.sleep(0.01)
            if hung:
                await store.get(["k"], [torch.zeros(4)])  # abandoned, still in its thread
            nursery.cancel_scope.cancel()
        # Without a call in flight the segment is unmounted; with one, closing under it
        # would free what the thread uses, so the client is left alone.
        assert client.closed.is_set() is not hung
        client.release.set()


async def test_a_failing_store_logs_one_line_per_period_and_counts_every_failure(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Dead(PerKey):
        def get_into(self, key: str, address: int, nbytes: int) -> int:
            return -900  # the master is gone

    import trio_encode.encoder.store as store_module

    monkeypatch.setattr(store_module, "_WARN_SECONDS", 0.3)
    events = Events()
    store = _store(events, wait=5.0)
    store._client = Dead()
    with caplog.at_level("WARNING", logger="trio_encode.encoder.store"):
        for _ in range(3):
            await store.get(["k"], [torch.zeros(4)])
        await trio.sleep(0.35)
        await store.get(["k"], [torch.zeros(4)])
    # The failures' lines (the store without a key says so once, at its start, too).
    lines = [r.getMessage() for r in caplog.records if "fleet secret" not in r.getMessage()]
    assert len(lines) == 2, lines
    assert "returned -900" in lines[0]
    assert "2 more store failures" in lines[1]
    assert events.lookups == [("error", 1)] * 4


async def test_a_store_client_that_raises_leaves_the_encoder_without_a_store() -> None:
    class Broken(FakeStoreClient):
        def setup(self, *args: object) -> int:
            raise TypeError("incompatible Mooncake build")

    events = Events()
    store = _store(events)
    store._store_class = Broken
    await store.run()  # returns instead of raising into the encoder's nursery
    assert not store.connected
    assert await store.get(["k"], [torch.zeros(4)]) == [None]
    assert events.lookups == [("unavailable", 1)]


async def test_a_restarted_store_gets_its_threads_back() -> None:
    """Stopping the store takes every thread token to close the client safely; it must give
    them back, or a store run again (a restarted encoder) times out on every lookup."""
    events = Events()
    store = _store(events, wait=2.0)
    client = FakeStoreClient()
    client.release.set()  # reads answer at once
    store._store_class = lambda: client
    for _ in range(2):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            await _until(lambda: store.connected)
            assert await store.get(["k"], [torch.zeros(4)]) != [None]
            nursery.cancel_scope.cancel()
    assert events.lookups == [("hit", 1), ("hit", 1)]


class ReadingClient(FakeStoreClient):
    """A store whose puts read their source only when released, as Mooncake's do when the
    master is slow: what it keeps is whatever the bytes are by then."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: dict[str, bytes] = {}
        self.putting = threading.Event()

    def get_into(self, key: str, address: int, nbytes: int) -> int:
        return -704  # a miss, at once

    def put_from(self, key: str, address: int, nbytes: int) -> int:
        self.putting.set()
        self.release.wait(10)
        self.stored[key] = ctypes.string_at(address, nbytes)
        return 0


async def _until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    """Poll for ``condition`` (set by a worker thread or a thread's callback)."""
    with trio.fail_after(seconds):
        while True:
            if condition():
                return
            await trio.sleep(0.01)


@asynccontextmanager
async def _serving_with_store(
    client: FakeStoreClient, events: Events
) -> AsyncIterator[tuple[ImageEncoder, Arena, MooncakeEmbeddingStore]]:
    """An encoder running with an arena of one segment and a store over ``client``, once the
    store is connected."""
    arena = Arena(4096, cache_bytes=4096)  # room for exactly one image's segment
    store = _store(events)
    store._store_class = lambda: client
    encoder = ImageEncoder(
        Fingerprinted(),
        replace(SETTINGS, cache_bytes=4096),
        run_decode=inline,
        run_forward=inline,
        store=store,
        arena=arena,
    )
    async with encoder_running(encoder):
        await _until(lambda: store.connected)
        yield encoder, arena, store


async def test_a_pending_store_put_keeps_its_segment_from_reuse() -> None:
    """Image X's row is offered to the store; the put waits (a slow master). X's request ends,
    and image Y needs a segment in a full arena. Y must not get X's segment while the put
    may still read it: else the store keeps Y's bytes under X's key, for the whole fleet."""
    events = Events()
    client = ReadingClient()
    async with _serving_with_store(client, events) as (encoder, arena, _):
        x = await encoder.encode([image(10)])
        assert isinstance(x, ArenaEmbedding)
        x_bytes = x.tensor.numpy().tobytes()
        assert await trio.to_thread.run_sync(client.putting.wait, 5)
        x.release()  # X's request is over; its put is not
        y = await encoder.encode([image(20)])  # the arena holds only X's segment
        assert y.tensor[0, 0] == 20
        client.release.set()  # the put reads now
        await _until(lambda: arena.leased_bytes == int(isinstance(y, ArenaEmbedding)) * 4096)
        key = store_key("fake-model", content_key("fake", image(10)))
        assert client.stored[key] == x_bytes, "the store holds another image under X's key"
        y.release()
    assert events.puts == ["stored", "stored"]
    assert arena.leased_bytes == 0


async def test_an_abandoned_store_put_keeps_its_lease_until_it_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A put given up on at its bound still runs in its thread, reading the segment: its lease
    goes back when that thread returns, not at the timeout."""
    import trio_encode.encoder.store as store_module

    monkeypatch.setattr(store_module, "_PUT_SECONDS", 0.05)
    events = Events()
    client = ReadingClient()
    async with _serving_with_store(client, events) as (encoder, arena, _):
        x = await encoder.encode([image(10)])
        x.release()
        await _until(lambda: events.puts == ["timeout"])
        await trio.sleep(0.05)
        assert arena.leased_bytes == 4096, "the abandoned put still reads its segment"
        client.release.set()
        await _until(lambda: arena.leased_bytes == 0)


async def test_a_put_given_up_before_its_thread_began_gives_back_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trio_encode.encoder.store as store_module

    monkeypatch.setattr(store_module, "_PUT_SECONDS", 0.05)
    events = Events()
    store = _store(events)
    client = HungClient()
    store._client = client
    for n in range(4):  # hung reads take every thread
        await store.get([f"k{n}"], [torch.zeros(4)])
    given_back: list[str] = []
    row = torch.zeros(4)
    digest = _digest_bytes(tensor_checksum(row))
    await store._put_now("p", row, digest, lambda: given_back.append("p"))
    assert given_back == ["p"]
    assert events.puts == ["timeout"]
    client.release.set()
    await trio.sleep(0.1)
    assert given_back == ["p"]  # once, and the write never ran
