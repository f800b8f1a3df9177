"""The encoder's queue, sharing, cancellation and failure logic, on Trio's mock clock.

The model here is a fake whose output row is the image's own colour, and the "thread" runs
inline after a virtual-time sleep, so no real thread meets the mock clock.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Callable
from dataclasses import replace

import pytest
import trio
import trio.testing

from support.fake_encoder import (
    FORWARD_SECONDS,
    SETTINGS,
    FakeBackend,
    SlowForward,
    T,
    encoder_running,
    image,
    inline,
    make,
    occupy_the_forward,
    reds,
)
from trio_encode.embedding import Embedding
from trio_encode.encoder import ImageEncoder
from trio_encode.errors import EncodeFailed, InvalidInput, NotReady, Overloaded, ShuttingDown


async def test_concurrent_requests_share_one_forward(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, events = make()
    results: dict[int, Embedding] = {}

    async def one(red: int) -> None:
        results[red] = await encoder.encode([image(red)])

    async with encoder_running(encoder), trio.open_nursery() as nursery:
        for red in (10, 20, 30):
            nursery.start_soon(one, red)
    assert [sorted(batch) for batch in backend.batches] == [[10, 20, 30]]
    assert events.batches == [(3, True)]
    for red, embedding in results.items():
        assert reds(embedding) == [red, red]
        assert (embedding.rows, embedding.dim, embedding.dtype) == (2, 3, "float32")
    # Without a cache, single-image embeddings are rows of one batched output: distinct,
    # non-overlapping ranges of the same memory.
    storages = {e.tensor.untyped_storage().data_ptr() for e in results.values()}
    assert len(storages) == 1
    addresses = sorted(e.address for e in results.values())
    assert all(b - a >= 2 * 3 * 4 for a, b in itertools.pairwise(addresses))


async def test_batches_hold_at_most_max_batch_size_images(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, _ = make(replace(SETTINGS, max_batch_size=2))
    async with encoder_running(encoder):
        embedding = await encoder.encode([image(r) for r in (1, 2, 3, 4, 5)])
    assert backend.batches == [[1, 2], [3, 4], [5]]
    assert reds(embedding) == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert embedding.rows == 10


async def test_a_lone_image_waits_at_most_max_batch_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, _, events = make(replace(SETTINGS, max_batch_wait=0.25))
    async with encoder_running(encoder):
        start = trio.current_time()
        await encoder.encode([image(1)])
        assert trio.current_time() - start == pytest.approx(0.25 + FORWARD_SECONDS)
    assert events.waits == [pytest.approx(0.25)]


async def test_images_queued_during_a_forward_do_not_wait_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, _ = make(replace(SETTINGS, max_batch_wait=0.5))
    async with encoder_running(encoder), trio.open_nursery() as nursery:
        nursery.start_soon(encoder.encode, [image(1)])
        await trio.sleep(0.6)  # the first batch is running now
        nursery.start_soon(encoder.encode, [image(2)])
        await trio.sleep(0.8)  # the first batch ends at 1.5; image 2 waited 0.9 by then
        start = trio.current_time()
        await encoder.encode([image(3)])
        # Image 3 joined image 2's batch at once: no new batch window, just the forward.
        assert trio.current_time() - start == pytest.approx(0.1 + FORWARD_SECONDS)
    assert backend.batches == [[1], [2, 3]]


async def test_full_queue_raises_overloaded(autojump_clock: trio.testing.MockClock) -> None:
    encoder, backend, events = make(replace(SETTINGS, max_batch_size=1, queue_size=3))
    outcomes: list[str] = []

    async def one(reds_: list[int]) -> None:
        await encoder.encode([image(r) for r in reds_])
        outcomes.append(",".join(map(str, reds_)))

    async with encoder_running(encoder):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, [1])
            await trio.sleep(0.1)  # image 1 is in the forward; the queue is empty
            nursery.start_soon(one, [2, 3])
            await trio.sleep(0.1)
            assert encoder.queued_images == 2
            with pytest.raises(Overloaded, match="queue is full"):
                await encoder.encode([image(4), image(5)])
            assert encoder.queued_images == 2
            nursery.start_soon(one, [6])  # exactly fills the queue
        assert events.rejections == [2]
        assert encoder.queued_images == 0
        await encoder.encode([image(4), image(5)])  # room again
    assert sorted(outcomes) == ["1", "2,3", "6"]
    assert 4 in backend.encoded


async def test_a_request_larger_than_the_queue_is_invalid(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, _, _ = make(replace(SETTINGS, queue_size=2))
    async with encoder_running(encoder):
        with pytest.raises(InvalidInput, match="at most 2"):
            await encoder.encode([image(1), image(2), image(3)])
        with pytest.raises(InvalidInput, match="at least one image"):
            await encoder.encode([])


async def test_loading_checks_the_image_count_before_anything_is_loaded() -> None:
    encoder, _, _ = make(replace(SETTINGS, queue_size=2))
    with pytest.raises(InvalidInput, match="mm_items is empty: send at least one image"):
        await encoder.load_items([])
    with pytest.raises(InvalidInput, match=r"3 images in one request; .* at most 2"):
        await encoder.load_items(["/nonexistent"] * 3)


async def test_cancelled_while_queued_is_removed_and_never_encoded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, _ = make(replace(SETTINGS, max_batch_size=1))
    async with encoder_running(encoder):
        async with trio.open_nursery() as nursery:
            await occupy_the_forward(encoder, nursery)
            with trio.move_on_after(0.3) as scope:
                await encoder.encode([image(2), image(3)])
            assert scope.cancelled_caught
            assert encoder.queued_images == 0
            nursery.start_soon(encoder.encode, [image(4)])
        await trio.sleep(5)
    assert backend.batches == [[1], [4]]


async def test_cancelled_while_its_batch_runs_gets_nothing_and_harms_nobody(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, _ = make()
    results: list[Embedding] = []
    async with encoder_running(encoder), trio.open_nursery() as nursery:

        async def sibling() -> None:
            results.append(await encoder.encode([image(2)]))

        nursery.start_soon(sibling)
        with trio.move_on_after(0.5) as scope:  # the batch starts at 0.01
            await encoder.encode([image(1)])
        assert scope.cancelled_caught
    assert [sorted(batch) for batch in backend.batches] == [[1, 2]]
    assert [reds(e) for e in results] == [[2, 2]]
    assert encoder.queued_images == 0


async def test_cancelled_with_some_images_running_withdraws_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, _ = make(replace(SETTINGS, max_batch_size=2))
    async with encoder_running(encoder):
        with trio.move_on_after(0.5):
            await encoder.encode([image(r) for r in (1, 2, 3, 4)])
        assert encoder.queued_images == 0
        await trio.sleep(5)
    assert backend.batches == [[1, 2]]


async def test_model_failure_fails_every_request_in_the_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, events = make()
    errors: list[EncodeFailed] = []

    async def one(red: int) -> None:
        try:
            await encoder.encode([image(red)])
        except EncodeFailed as exc:
            errors.append(exc)

    async with encoder_running(encoder):
        backend.fail = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 1)
            nursery.start_soon(one, 2)
        assert len(errors) == 2
        assert errors[0] is not errors[1]
        assert all("out of cheese" in e.message for e in errors)
        # The encoder keeps serving after a failed batch.
        backend.fail = False
        assert reds(await encoder.encode([image(3)])) == [3, 3]
    assert events.batches == [(2, False), (1, True)]


async def test_cached_requests_never_touch_the_queue_and_share_memory(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, events = make(replace(SETTINGS, cache_bytes=1 << 20))
    async with encoder_running(encoder):
        first = await encoder.encode([image(1)])
        start = trio.current_time()
        again = await encoder.encode([image(1)])
        assert trio.current_time() == start  # no batch window, no forward
        assert again.tensor is first.tensor
        assert again.address == first.address
        mixed = await encoder.encode([image(2), image(1)])
    assert backend.batches == [[1], [2]]
    assert reds(mixed) == [2, 2, 1, 1]
    assert mixed.address != first.address  # several images: concatenated into new memory
    assert events.lookups == [(0, 1), (1, 0), (1, 1)]
    assert events.sizes[-1] == (2 * 2 * 3 * 4, 2)


async def test_bad_image_is_invalid_input_and_leaves_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, _ = make()
    async with encoder_running(encoder):
        with pytest.raises(InvalidInput, match=r"mm_items\[1\]: the data is not a PNG"):
            await encoder.encode([image(1), b"not an image"])
        assert encoder.queued_images == 0
    assert backend.batches == []


async def test_load_items_names_the_bad_entry(autojump_clock: trio.testing.MockClock) -> None:
    encoder, _, _ = make()
    good = "data:image/png;base64," + base64.b64encode(image(1)).decode()
    assert await encoder.load_items([good]) == [base64.b64decode(good.partition(",")[2])]
    with pytest.raises(InvalidInput, match=r"mm_items\[1\]: unsupported image type"):
        await encoder.load_items([good, "data:image/tiff;base64,SUkq"])


async def test_not_running_is_not_ready_and_stopping_fails_waiters(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, _ = make(replace(SETTINGS, max_batch_size=1))
    with pytest.raises(NotReady, match="not ready"):
        await encoder.encode([image(1)])
    errors: list[ShuttingDown] = []

    async def one(red: int) -> None:
        try:
            await encoder.encode([image(red)])
        except ShuttingDown as exc:
            errors.append(exc)

    async with trio.open_nursery() as outer, trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        outer.start_soon(one, 1)
        await trio.sleep(0.1)
        outer.start_soon(one, 2)
        await trio.sleep(0.1)
        assert encoder.ready
        nursery.cancel_scope.cancel()  # image 1 is running, image 2 is queued
    assert not encoder.ready
    assert len(errors) == 2
    assert encoder.queued_images == 0
    with pytest.raises(ShuttingDown):
        await encoder.encode([image(3)])
    assert backend.batches == []


async def test_warm_up_runs_before_ready(autojump_clock: trio.testing.MockClock) -> None:
    encoder, backend, _ = make(replace(SETTINGS, warmup=True))
    assert not encoder.ready
    async with encoder_running(encoder):
        assert encoder.ready
        assert backend.batches == [[0]]
    info = encoder.info
    assert (info.tokens_per_image, info.hidden_size, info.dtype) == (2, 3, "float32")
    assert info.bytes_per_image == 2 * 3 * 4


# -- one job per image while it is queued or running -----------------------------------------


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
async def test_concurrent_requests_with_the_same_image_encode_it_once(
    autojump_clock: trio.testing.MockClock, cache_bytes: int
) -> None:
    encoder, backend, _ = make(replace(SETTINGS, cache_bytes=cache_bytes))
    results: dict[str, Embedding] = {}

    async def one(name: str, reds_: list[int]) -> None:
        results[name] = await encoder.encode([image(r) for r in reds_])

    async with encoder_running(encoder), trio.open_nursery() as nursery:
        nursery.start_soon(one, "a", [5])
        nursery.start_soon(one, "b", [5])
        nursery.start_soon(one, "mixed", [5, 6, 5])  # shared, its own, and its own duplicate
    assert [sorted(batch) for batch in backend.batches] == [[5, 6]]
    assert reds(results["a"]) == reds(results["b"]) == [5, 5]
    assert reds(results["mixed"]) == [5, 5, 6, 6, 5, 5]
    # The shared row is one tensor: the registration ledger leases identical ranges.
    assert results["a"].tensor is results["b"].tensor
    assert encoder.batcher.in_flight == {}
    assert encoder.queued_images == 0


async def test_an_image_queued_while_another_request_decoded_it_is_joined(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow_decode(fn: Callable[[], T]) -> T:
        await trio.sleep(0.001)
        return fn()

    encoder = ImageEncoder(FakeBackend(), SETTINGS, run_decode=slow_decode, run_forward=inline)
    backend = encoder.backend
    assert isinstance(backend, FakeBackend)
    results: list[Embedding] = []

    async def one() -> None:
        results.append(await encoder.encode([image(5)]))

    async with encoder_running(encoder), trio.open_nursery() as nursery:
        nursery.start_soon(one)  # both miss the in-flight map and decode image 5
        nursery.start_soon(one)
    assert backend.batches == [[5]]
    assert [reds(e) for e in results] == [[5, 5], [5, 5]]
    assert encoder.batcher.in_flight == {}


async def test_first_requester_cancelled_while_queued_leaves_the_job_to_the_second(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, _ = make(replace(SETTINGS, max_batch_size=1))
    results: list[Embedding] = []

    async def second() -> None:
        results.append(await encoder.encode([image(2)]))

    async with encoder_running(encoder):
        async with trio.open_nursery() as nursery:
            await occupy_the_forward(encoder, nursery)
            with trio.move_on_after(0.3) as scope:
                nursery.start_soon(second)
                await encoder.encode([image(2)])
            assert scope.cancelled_caught
            assert encoder.queued_images == 1  # still queued: the second request waits for it
        assert encoder.batcher.in_flight == {}
        assert encoder.queued_images == 0
    assert backend.batches == [[1], [2]]
    assert [reds(e) for e in results] == [[2, 2]]


async def test_every_requester_cancelled_while_queued_withdraws_the_shared_job(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, _ = make(replace(SETTINGS, max_batch_size=1))
    async with encoder_running(encoder):
        async with trio.open_nursery() as nursery:
            await occupy_the_forward(encoder, nursery)
            with trio.move_on_after(0.3):
                async with trio.open_nursery() as requesters:
                    requesters.start_soon(encoder.encode, [image(2)])
                    requesters.start_soon(encoder.encode, [image(2), image(3)])
            assert encoder.queued_images == 0
            assert len(encoder.batcher.in_flight) == 1  # only image 1's job, still running
        await trio.sleep(5)
        assert encoder.batcher.in_flight == {}
    assert backend.batches == [[1]]


async def test_model_failure_reaches_every_request_waiting_on_the_job(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, events = make()
    errors: list[EncodeFailed] = []

    async def one() -> None:
        with pytest.raises(EncodeFailed, match="out of cheese") as info:
            await encoder.encode([image(4)])
        errors.append(info.value)

    async with encoder_running(encoder):
        backend.fail = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
        assert len(errors) == 2
        assert encoder.batcher.in_flight == {}
        backend.fail = False
        assert reds(await encoder.encode([image(4)])) == [4, 4]  # a new job, not the failed one
    assert events.batches == [(1, False), (1, True)]


async def test_a_shared_image_counts_once_against_the_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    encoder, backend, events = make(replace(SETTINGS, max_batch_size=1, queue_size=3))
    results: list[Embedding] = []

    async def sharer() -> None:
        results.append(await encoder.encode([image(2), image(4)]))

    async with encoder_running(encoder):
        async with trio.open_nursery() as nursery:
            await occupy_the_forward(encoder, nursery)
            with trio.move_on_after(0.3):
                async with trio.open_nursery() as first:
                    first.start_soon(encoder.encode, [image(2), image(3)])
                    await trio.sleep(0.1)
                    assert encoder.queued_images == 2
                    nursery.start_soon(sharer)  # only image 4 is new: 3 of 3
                    await trio.sleep(0.1)
                    assert encoder.queued_images == 3
                    with pytest.raises(Overloaded, match="queue is full"):
                        await encoder.encode([image(5)])
            # The first request is gone: image 3 left the queue, image 2 stays for the sharer.
            assert encoder.queued_images == 2
        assert encoder.queued_images == 0
        assert encoder.batcher.in_flight == {}
    assert events.rejections == [1]
    assert backend.batches == [[1], [2], [4]]
    assert [reds(e) for e in results] == [[2, 2, 4, 4]]


async def test_caller_cancelled_during_its_decode_sees_cancelled_not_shutting_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The encoder stops while a cancelled caller's decode thread still runs: when the thread
    returns, the caller gets its cancellation, not a ShuttingDown it would have to handle."""

    async def thread_like_decode(fn: Callable[[], T]) -> T:
        with trio.CancelScope(shield=True):  # a started thread runs to its end
            await trio.sleep(1.0)
        return fn()

    backend = FakeBackend()
    encoder = ImageEncoder(
        backend, SETTINGS, run_decode=thread_like_decode, run_forward=SlowForward()
    )
    outcome: list[BaseException] = []

    async def caller() -> None:
        try:
            await encoder.encode([image(1)])
        except BaseException as exc:
            outcome.append(exc)
            raise

    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        nursery.start_soon(caller)
        await trio.sleep(1.5)  # the content-key decode is done; the pixel decode is running
        nursery.cancel_scope.cancel()  # stops the encoder and cancels the caller together
    assert len(outcome) == 1
    assert isinstance(outcome[0], trio.Cancelled)
    assert backend.batches == []
