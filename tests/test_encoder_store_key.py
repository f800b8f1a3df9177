"""A fleet secret (``store_key_file``) makes the store's digest a MAC: with a real
``mooncake_master``, only what an encoder holding the secret wrote under that name is served."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
import trio
import xxhash

from support.cluster import start_master
from support.fake_encoder import encoder_running
from support.models import SMALL
from trio_encode.client import metric_value
from trio_encode.embedding import tensor_checksum
from trio_encode.encoder import ImageEncoder
from trio_encode.encoder.cache import content_key
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.encoder.store import (
    _HEADER,
    MooncakeEmbeddingStore,
    NullStoreObserver,
    _body,
    _describe,
    _digest_bytes,
    store_key,
)
from trio_encode.server.metrics import Metrics
from trio_encode.settings import ServerSettings
from trio_encode.testing.images import noise_png

ROW = 16 * 256 * 4  # SMALL's float32 embedding of one image


class Member:
    """One encoder of the fleet, with its own store client and its own metrics."""

    def __init__(self, settings: EncoderSettings) -> None:
        self.metrics = Metrics()
        self.store = MooncakeEmbeddingStore.from_settings(
            settings, hostname="127.0.0.1", protocol="tcp", device="", observer=self.metrics
        )
        self.encoder = ImageEncoder.from_settings(settings, observer=self.metrics, store=self.store)

    def count(self, name: str, **labels: str) -> float:
        return metric_value(self.metrics.render().decode(), name, **labels)

    def name(self, image: bytes) -> str:
        return self.store.entry_name(self.unkeyed(image))

    def unkeyed(self, image: bytes) -> str:
        model = self.encoder.model
        return store_key(model.fingerprint, content_key(model.model_id, image))

    async def encode(self, image: bytes) -> bytes:
        embedding = await self.encoder.encode([image])
        try:
            data = embedding.tensor.view(torch.uint8).numpy().tobytes()
            assert xxhash.xxh3_64_hexdigest(data) == embedding.checksum.partition(":")[2]
            return data
        finally:
            embedding.release()


async def _until(condition: Callable[[], bool], seconds: float = 30.0) -> None:
    with trio.fail_after(seconds):
        while True:
            if condition():
                return
            await trio.sleep(0.02)


async def test_with_a_fleet_secret_only_entries_sealed_by_the_fleet_are_served(
    tmp_path: Path,
) -> None:
    """Encoder A stores image X; B (same secret) gets it from the store without a forward. A
    stranger's store client then writes other bytes under X's name with their correct XXH3
    digest (a consistent entry without the secret): B finds it poisoned, removes and counts it,
    encodes X again and serves the right bytes. A valid entry of image Y copied under X's name
    is poisoned too (the name is sealed), and an unkeyed entry is not even looked at."""
    from mooncake.store import MooncakeDistributedStore

    master = start_master(tmp_path)
    secret = tmp_path / "store.key"
    secret.write_text("the fleet's secret\n")
    settings = replace(
        SMALL,
        cache_bytes=0,  # every lookup goes to the store
        store_master=master.address,
        store_segment_bytes=16 << 20,
        store_buffer_bytes=16 << 20,
        store_wait=5.0,
        store_key_file=secret,
    )
    stranger = MooncakeDistributedStore()
    try:
        setup = partial(stranger.setup, "127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp")
        assert await trio.to_thread.run_sync(setup, "", master.address) == 0
        a, b = Member(settings), Member(settings)
        x, y, z = noise_png(1), noise_png(2), noise_png(3)
        async with encoder_running(a.encoder), encoder_running(b.encoder):
            await _until(lambda: a.store.connected and b.store.connected)
            clean = await a.encode(x)
            await _until(lambda: a.count("store_puts_total", result="stored") == 1)
            assert b.name(x) == a.name(x)
            assert b.name(x).startswith("trio-encode/keyed/")

            assert await b.encode(x) == clean
            assert b.count("store_lookups_total", result="hit") == 1
            assert b.count("encoder_batch_size_sum") == 0, "a clean hit runs no forward"

            # A stranger's entry, consistent as the unkeyed layout checks it.
            entry = await trio.to_thread.run_sync(stranger.get, b.name(x))
            assert len(entry) == 8 + _HEADER + ROW
            other = b"\x07" * ROW
            digest = xxhash.xxh3_64_digest(other)
            body = _body(None, ())
            assert body is not None
            forged = digest + _describe(None, b.name(x), digest, body) + other
            assert await trio.to_thread.run_sync(stranger.upsert, b.name(x), forged) == 0
            assert await b.encode(x) == clean
            assert b.count("store_lookups_total", result="poisoned") == 1
            assert b.count("encoder_cache_poisoned_total", source="store") == 1
            assert b.count("encoder_batch_size_sum") == 1, "encoded again"
            await _until(lambda: b.count("store_puts_total", result="stored") == 1)

            # A valid entry of Y, copied under X's name.
            await a.encode(y)
            await _until(lambda: a.count("store_puts_total", result="stored") == 2)
            entry_y = await trio.to_thread.run_sync(stranger.get, a.name(y))
            assert await trio.to_thread.run_sync(stranger.upsert, b.name(x), entry_y) == 0
            assert await b.encode(x) == clean
            assert b.count("store_lookups_total", result="poisoned") == 2
            assert b.count("encoder_batch_size_sum") == 2

            # An entry written without the secret lives under another name: a miss, not read.
            unkeyed = b.unkeyed(z)
            assert unkeyed != b.name(z)
            assert await trio.to_thread.run_sync(stranger.upsert, unkeyed, forged) == 0
            await b.encode(z)
            assert b.count("store_lookups_total", result="miss") == 1
            assert b.count("store_lookups_total", result="poisoned") == 2
    finally:
        await trio.to_thread.run_sync(stranger.close)
        master.stop()


def test_the_store_key_file_is_read_once_at_start_and_never_shown(tmp_path: Path) -> None:
    secret = tmp_path / "store.key"
    secret.write_text("  s3cret-of-the-fleet  \nignored\n")
    settings = ServerSettings.exactly(store_key_file=secret)
    assert settings.encoder.store_secret == b"s3cret-of-the-fleet"
    assert "s3cret" not in repr(settings)
    assert EncoderSettings().store_secret is None
    empty = tmp_path / "empty.key"
    empty.write_text("\n  \n")
    binary = tmp_path / "binary.key"
    binary.write_bytes(b"\xff\xfes3cret")
    for path, reason in (
        (tmp_path / "missing.key", "No such file"),
        (empty, "is empty"),
        (binary, "not UTF-8"),
    ):
        with pytest.raises(ValueError, match=f"store_key_file {path}.*{reason}") as refused:
            ServerSettings.exactly(store_key_file=path)
        assert "s3cret" not in str(refused.value)


async def test_a_row_changed_since_its_forward_is_never_sealed() -> None:
    """The seal is computed from the row when the put runs, long after the forward: a row
    written into meanwhile (through the engine, into the arena) must not be sealed as the
    fleet's, or every encoder would serve it as a clean hit."""

    class Recording:
        def __init__(self) -> None:
            self.stored: list[str] = []

        def batch_put_from_multi_buffers(self, names: list[str], *buffers: object) -> list[int]:
            self.stored += names
            return [0] * len(names)

    puts: list[str] = []

    class Observer(NullStoreObserver):
        def store_put(self, result: str) -> None:
            puts.append(result)

    store = MooncakeEmbeddingStore(
        master="127.0.0.1:1", segment_bytes=1 << 20, buffer_bytes=1 << 20, wait=1.0,
        observer=Observer(), secret=b"the fleet's secret",
    )  # fmt: skip
    client = store._client = Recording()
    row = torch.zeros(4)
    recorded = _digest_bytes(tensor_checksum(row))  # the forward's checksum
    row[0] = 7  # a write into the row since
    await store._put_now("changed", row, recorded, None)
    await store._put_now("clean", torch.zeros(4), recorded, None)
    assert puts == ["failed", "stored"]
    assert client.stored == [store.entry_name("clean")]


@pytest.mark.parametrize("secret", [None, b"the fleet's secret"])
def test_a_store_without_a_fleet_secret_says_so_once_at_start(
    caplog: pytest.LogCaptureFixture, secret: bytes | None
) -> None:
    """Without a secret a stranger's consistent entry is served undetected and no metric shows
    it: the start-up log is the only place that can say so."""
    with caplog.at_level(logging.WARNING, logger="trio_encode.encoder.store"):
        MooncakeEmbeddingStore(
            master="127.0.0.1:1", segment_bytes=1 << 20, buffer_bytes=1 << 20, wait=1.0,
            secret=secret,
        )  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if r.name == "trio_encode.encoder.store"]
    if secret is not None:
        assert warnings == []
        return
    (warning,) = warnings
    assert "127.0.0.1:1" in warning
    assert "without a fleet secret" in warning
    assert "lists every key" in warning
    assert "--store-key-file" in warning
