"""A cache row that appeared while this request's store lookup was in flight, on the mock
clock with a store whose lookup blocks until the test lets it answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import trio
import trio.testing

from support.fake_encoder import (
    SETTINGS,
    Fingerprinted,
    SlowForward,
    encoder_running,
    image,
    inline,
    reds,
)
from trio_encode.embedding import Embedding, tensor_checksum
from trio_encode.encoder import ImageEncoder, content_key
from trio_encode.encoder.store import StoreHit


class BlockingStore:
    """An EmbeddingStore whose lookups miss, each once ``answer`` is set."""

    def __init__(self) -> None:
        self.answer = trio.Event()
        self.asked = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[StoreHit | None]:
        self.asked.set()
        await self.answer.wait()
        return [None for _ in keys]

    def put(
        self,
        key: str,
        tensor: torch.Tensor,
        checksum: str,
        done: Callable[[], None] | None = None,
        **described: object,
    ) -> None:
        if done is not None:
            done()


class Poisoned:
    """An EncoderObserver that counts poisoned rows, by source."""

    def __init__(self) -> None:
        self.poisoned: dict[str, int] = {}

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None

    def cache_poisoned(self, images: int, source: str) -> None:
        self.poisoned[source] = self.poisoned.get(source, 0) + images


async def test_a_cache_row_found_after_a_store_miss_is_verified_before_it_is_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """While the request's store lookup is in flight, a forward elsewhere puts the image's row
    in the cache, and the row is then overwritten (as a write into a registered row would).
    The store misses: the request takes the cached row only after checking it, finds it
    poisoned, drops and counts it, and encodes the image again."""
    store = BlockingStore()
    observer = Poisoned()
    backend = Fingerprinted()
    encoder = ImageEncoder(
        backend,
        replace(SETTINGS, cache_bytes=1 << 20),
        observer=observer,
        run_decode=inline,
        run_forward=SlowForward(),
        store=store,
    )
    data = image(90)
    key = content_key(backend.model_id, data)
    cache = encoder.cache
    assert cache is not None
    async with encoder_running(encoder) as nursery:
        got = []

        async def request() -> None:
            got.append(await encoder.encode([data]))

        nursery.start_soon(request)
        await store.asked.wait()
        # A forward elsewhere finished and kept the right row ...
        row = torch.full((2, 3), 90.0)
        row[:, 1:] = torch.tensor([7.0, 9.0])
        cache.put(key, row, tensor_checksum(row))
        # ... which something then overwrote while it lay registered.
        row.fill_(13.0)
        store.answer.set()
        while not got:  # noqa: ASYNC110 (the request ends on its own)
            await trio.sleep(0.01)
    (served_now,) = got
    assert isinstance(served_now, Embedding)  # one image, encoded here: one tensor
    assert reds(served_now) == [90, 90], "the overwritten row was served"
    assert backend.encoded == [90], "the image was not encoded again"
    assert observer.poisoned == {"cache": 1}
    served = cache.get(key)
    assert served is None or bool((served[:, 0] == 90).all())
