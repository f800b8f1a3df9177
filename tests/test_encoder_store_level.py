"""The encoder's second cache level on the mock clock, with a dictionary for a store: what is
looked up, when the forward runs, and what is offered back."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import trio
import trio.testing

from support.fake_encoder import (
    SETTINGS,
    FakeBackend,
    Fingerprinted,
    SlowForward,
    encoder_running,
    image,
    inline,
    reds,
)
from trio_encode.embedding import tensor_checksum
from trio_encode.encoder import ImageEncoder
from trio_encode.encoder.backend import ItemMeta
from trio_encode.encoder.store import StoreHit
from trio_encode.request_types import Grid

FORWARD = 1.0


class DictStore:
    """An EmbeddingStore over a dict; lookups take ``latency`` of virtual time."""

    def __init__(self, latency: float = 0.001) -> None:
        self.entries: dict[str, torch.Tensor] = {}
        self.described: dict[str, tuple[Grid | None, ItemMeta]] = {}
        self.latency = latency
        self.gets: list[list[str]] = []
        self.puts: list[str] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[StoreHit | None]:
        self.gets.append(list(keys))
        await trio.sleep(self.latency)
        found: list[StoreHit | None] = []
        for key, tensor in zip(keys, into, strict=True):
            if key in self.entries:
                tensor.copy_(self.entries[key])
                found.append(StoreHit(tensor_checksum(tensor), *self.described[key]))
            else:
                found.append(None)
        return found

    def put(
        self,
        key: str,
        tensor: torch.Tensor,
        checksum: str,
        done: Callable[[], None] | None = None,
        *,
        grid: Grid | None = None,
        meta: ItemMeta = (),
    ) -> None:
        assert checksum == tensor_checksum(tensor), "offered with the checksum of its bytes"
        self.puts.append(key)
        self.entries[key] = tensor.clone()
        self.described[key] = (grid, meta)
        if done is not None:
            done()


def make(store: DictStore, backend: FakeBackend | None = None) -> tuple[ImageEncoder, FakeBackend]:
    backend = backend or Fingerprinted()
    encoder = ImageEncoder(
        backend, SETTINGS, run_decode=inline, run_forward=SlowForward(), store=store
    )
    return encoder, backend


async def test_a_store_hit_skips_the_forward_and_a_forward_is_offered_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = DictStore()
    first, first_model = make(store)
    async with encoder_running(first):
        computed = await first.encode([image(40)])
    assert first_model.encoded == [40]
    assert len(store.puts) == 1
    assert store.puts[0].startswith("trio-encode/checked/v2/fake-model/IMAGE/-/")

    second, second_model = make(store)  # another encoder of the fleet, same model
    async with encoder_running(second):
        served = await second.encode([image(40)])
    assert second_model.encoded == []
    assert reds(served) == reds(computed)
    assert torch.equal(served.tensor, computed.tensor)
    assert len(store.puts) == 1  # a hit is not stored again


async def test_images_in_flight_here_are_joined_not_looked_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = DictStore()
    encoder, model = make(store)
    async with encoder_running(encoder), trio.open_nursery() as nursery:
        nursery.start_soon(encoder.encode, [image(50)])
        await trio.sleep(FORWARD / 2)  # the first missed the store and runs its forward
        await encoder.encode([image(50)])
    assert model.encoded == [50]
    assert len(store.gets) == 1  # only the first request asked the store


async def test_a_model_with_another_fingerprint_does_not_hit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = DictStore()
    first, _ = make(store)
    async with encoder_running(first):
        await first.encode([image(60)])

    class Other(FakeBackend):
        fingerprint = "other-model"

    second, other = make(store, Other())
    async with encoder_running(second):
        await second.encode([image(60)])
    assert other.encoded == [60]


async def test_requests_for_an_image_being_read_from_the_store_share_the_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = DictStore(latency=0.1)
    seeded, _ = make(store)
    async with encoder_running(seeded):
        computed = await seeded.encode([image(70)])
    store.gets.clear()
    encoder, model = make(store)
    got = []

    async def one() -> None:
        got.append(await encoder.encode([image(70)]))

    async with encoder_running(encoder), trio.open_nursery() as nursery:
        nursery.start_soon(one)
        await trio.sleep(0.05)  # the first request's store read is under way
        nursery.start_soon(one)
    assert model.encoded == []
    assert len(store.gets) == 1
    assert all(torch.equal(e.tensor, computed.tensor) for e in got)
    assert len(got) == 2


async def test_a_cancelled_reader_releases_those_waiting_on_its_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = DictStore(latency=0.1)
    encoder, model = make(store)
    async with encoder_running(encoder), trio.open_nursery() as nursery:
        reader = trio.CancelScope()

        async def cancelled_reader() -> None:
            with reader:
                await encoder.encode([image(80)])

        nursery.start_soon(cancelled_reader)
        await trio.sleep(0.05)
        waiter = trio.CancelScope(deadline=trio.current_time() + 10)
        result = []

        async def waiting() -> None:
            with waiter:
                result.append(await encoder.encode([image(80)]))

        nursery.start_soon(waiting)
        await trio.testing.wait_all_tasks_blocked()
        reader.cancel()
    # The waiter was not left hanging: it ran the forward itself (the store had nothing).
    assert not waiter.cancelled_caught
    assert model.encoded == [80]
    assert reds(result[0]) == [80, 80]
