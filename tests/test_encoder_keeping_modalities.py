"""Every modality kept alike: an item's key names its modality and recipe, and its row is kept
with its grid and metadata at every level, so a repeated video is a hit whose answer is the
first one's, and nothing is ever shared across modalities or frame samplings.

A fixed-token fake model (its image rows are the image's colour) gets a stand-in video path
(its rows and metadata follow the video's bytes and the frame rate), so videos reach every level,
the cluster-wide store included, through an in-process Mooncake Store client that keeps each
entry as the bytes a real one would. A tiny random-weight Qwen2.5-VL checks the local hit of a
real video path.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import trio
import trio.testing
import xxhash

from support.fake_encoder import SETTINGS, Fingerprinted, SlowForward, image, inline
from trio_encode.arena import Arena
from trio_encode.client import FleetClient
from trio_encode.client.ranking import content_digest, rank
from trio_encode.embedding import Embedding, RowsEmbedding, tensor_checksum
from trio_encode.encoder import EncoderSettings, ImageEncoder
from trio_encode.encoder.cache import content_key
from trio_encode.encoder.front import key_recipe
from trio_encode.encoder.store import (
    _HEADER,
    MooncakeEmbeddingStore,
    _body,
    _describe,
    _digest_bytes,
    store_key,
)
from trio_encode.encoder.video import FrameSampling
from trio_encode.encoder.vlm_video import PreparedVideo, VideoPath
from trio_encode.request_types import Media
from trio_encode.testing.tiny_vlm import save_tiny_model
from trio_encode.testing.videos import write_video

DATA = image(40)
"""One item's bytes, sent as an image and as a video: the fake model's image row is
``(40, 7, 9)``; the stand-in video path's rows are its own."""


class StandInVideo:
    """A video path for the fake model: a video's two rows and its metadata follow its bytes
    and the frame rate, as a real path's do; each forward's videos are written down."""

    def __init__(self, fps: float = 2.0) -> None:
        self.sampling = FrameSampling(fps=fps)
        self.forwarded: list[float] = []

    @property
    def recipe(self) -> dict[str, Any]:
        return {"sampling": asdict(self.sampling)}

    def prepare(self, decoded: bytes) -> PreparedVideo:
        fps = self.sampling.fps
        value = float(xxhash.xxh3_64_intdigest(decoded) % 97) + 1000 * fps
        return PreparedVideo(
            torch.tensor([value]),
            2,
            (1, 2, 4),
            second_per_grid_ts=2 / fps,
            video_timestamps=(0.25, 0.25 + 2 / fps),
        )

    def features(self, videos: Sequence[PreparedVideo]) -> list[torch.Tensor]:
        self.forwarded += [float(video.pixels[0]) for video in videos]
        return [torch.full((2, 3), float(video.pixels[0])) for video in videos]

    def expected(self, data: bytes) -> tuple[list[float], tuple[int, ...], Media]:
        """The answer a video of ``data`` must get: its rows, grid and part metadata."""
        prepared = self.prepare(data)
        meta = tuple((name, [value]) for name, value in prepared.meta)
        return [float(prepared.pixels[0])] * 2, (1, 2, 4), Media("VIDEO", meta)


@pytest.fixture
def videos_are_their_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in path prepares a video from its bytes as they are: no container to check
    or decode."""
    import trio_encode.encoder.batcher as batcher

    monkeypatch.setattr(batcher, "decode_video", lambda data, *args, **kwargs: data)
    monkeypatch.setattr(batcher, "check_header", lambda *args, **kwargs: None, raising=False)


async def _until(condition: Callable[[], bool]) -> None:
    """Poll for ``condition`` (set by the store's worker threads)."""
    with trio.fail_after(5):
        while True:
            if condition():
                return
            await trio.sleep(0.005)


class FakeMooncake:
    """Mooncake Store's client as the store uses it, in this process: an entry is the bytes of
    the buffers it was put from, end to end, read back into buffers of the same sizes."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def setup(self, *args: object) -> int:
        return 0

    def close(self) -> None:
        pass

    def batch_put_from_multi_buffers(
        self, keys: list[str], pointers: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        with self._lock:
            for key, at, lengths in zip(keys, pointers, sizes, strict=True):
                parts = zip(at, lengths, strict=True)
                self.objects[key] = b"".join(ctypes.string_at(a, n) for a, n in parts)
        return [0] * len(keys)

    def batch_get_into_multi_buffers(
        self, keys: list[str], pointers: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        codes = []
        for key, at, lengths in zip(keys, pointers, sizes, strict=True):
            with self._lock:
                data = self.objects.get(key)
            if data is None:
                codes.append(-704)
            elif len(data) > sum(lengths):
                codes.append(-600)  # the buffers are too small for it
            else:
                offset = 0
                for address, length in zip(at, lengths, strict=True):
                    part = data[offset : offset + length]
                    ctypes.memmove(address, part, len(part))
                    offset += length
                codes.append(len(data))
        return codes

    def remove(self, key: str, force: bool = False) -> int:
        with self._lock:
            self.objects.pop(key, None)
        return 0


@dataclass
class StoreEvents:
    lookups: list[str] = field(default_factory=list)
    puts: list[str] = field(default_factory=list)

    def store_connected(self, connected: bool) -> None:
        pass

    def store_looked_up(self, result: str, images: int) -> None:
        self.lookups += [result] * images

    def store_put(self, result: str) -> None:
        self.puts.append(result)


@dataclass
class Member:
    """One encoder of the test's fleet: its fake model, video path and store events."""

    encoder: ImageEncoder
    model: Fingerprinted
    video: StandInVideo
    events: StoreEvents

    @property
    def forwards(self) -> int:
        return len(self.model.encoded) + len(self.video.forwarded)

    async def answer(
        self, data: bytes, modality: str
    ) -> tuple[list[float], tuple[int, ...] | None, Media]:
        """The first value of each row, the grid and the media of ``data``'s embedding."""
        embedding = await self.encoder.encode([data], modality)
        assert isinstance(embedding, Embedding | RowsEmbedding)
        try:
            rows = [float(v) for v in embedding.tensor[:, 0]]
            (grid,) = embedding.grids or (None,)
            return rows, grid, embedding.media
        finally:
            embedding.release()

    async def stored(self, count: int) -> None:
        """Wait until ``count`` puts have been stored (they run in the background)."""
        await _until(lambda: self.events.puts.count("stored") >= count)


@asynccontextmanager
async def member(
    level: str,
    *,
    fps: float = 2.0,
    client: FakeMooncake | None = None,
    secret: bytes | None = None,
) -> AsyncIterator[Member]:
    """An encoder keeping rows at ``level``: ``cache`` (plain memory), ``arena``, ``store``
    (nothing local: every repeat is read from ``client``), or ``arena+store``."""
    events = StoreEvents()
    store = None
    if "store" in level:
        store = MooncakeEmbeddingStore(
            master="127.0.0.1:1", segment_bytes=1 << 20, buffer_bytes=1 << 20, wait=5.0,
            observer=events, secret=secret,
        )  # fmt: skip
        fake = client or FakeMooncake()
        store._store_class = lambda: fake
    arena = Arena(1 << 16, cache_bytes=1 << 16) if "arena" in level else None
    model, video = Fingerprinted(), StandInVideo(fps)
    encoder = ImageEncoder(
        model,
        replace(SETTINGS, cache_bytes=(1 << 16) if level in ("cache", "arena") else 0),
        run_decode=inline,
        run_forward=inline,
        store=store,
        arena=arena,
        video=cast(VideoPath, video),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        if store is not None:
            await _until(lambda: store.connected)
        yield Member(encoder, model, video, events)
        nursery.cancel_scope.cancel()


IMAGE_ANSWER = ([40.0, 40.0], None, Media())


def test_an_items_key_names_its_modality_and_its_recipe() -> None:
    image_key = content_key("m", DATA)
    video_key = content_key(
        "m", DATA, "VIDEO", key_recipe("VIDEO", cast(VideoPath, StandInVideo()))
    )
    slower = content_key(
        "m", DATA, "VIDEO", key_recipe("VIDEO", cast(VideoPath, StandInVideo(fps=4.0)))
    )
    same = content_key("m", DATA, "VIDEO", key_recipe("VIDEO", cast(VideoPath, StandInVideo())))
    assert key_recipe("IMAGE", cast(VideoPath, StandInVideo())) == ""
    # A modality without a recipe of its own is still apart from images.
    assert content_key("m", DATA, "AUDIO") != image_key
    assert len({image_key, video_key, slower}) == 3
    assert same == video_key
    names = {store_key("fingerprint", key) for key in (image_key, video_key, slower)}
    assert len(names) == 3, "the store's names keep them apart too"


@pytest.mark.usefixtures("videos_are_their_bytes")
@pytest.mark.parametrize("level", ["cache", "arena", "store"])
async def test_the_same_bytes_as_an_image_and_as_a_video_never_share_an_entry(
    level: str,
) -> None:
    """Both are kept; each repeat is served from its own entry, with no forward: never the
    image's row for the video, nor the video's metadata for the image."""
    async with member(level) as one:
        assert await one.answer(DATA, "IMAGE") == IMAGE_ANSWER
        if level == "store":
            await one.stored(1)
        video = await one.answer(DATA, "VIDEO")
        assert video == one.video.expected(DATA)
        if level == "store":
            await one.stored(2)
        assert one.forwards == 2
        assert await one.answer(DATA, "IMAGE") == IMAGE_ANSWER
        assert await one.answer(DATA, "VIDEO") == video
        assert one.forwards == 2, "both repeats are hits"
        if level == "store":
            assert one.events.lookups == ["miss", "miss", "hit", "hit"]


@pytest.mark.usefixtures("videos_are_their_bytes")
async def test_a_repeated_video_is_served_from_the_store_with_its_metadata() -> None:
    """Encoder A encodes a video; B reads it from the store (no forward) and keeps it in its
    arena; B's next request is a local hit. All three answers are identical."""
    client = FakeMooncake()
    async with (
        member("arena+store", client=client) as a,
        member("arena+store", client=client) as b,
    ):
        first = await a.answer(DATA, "VIDEO")
        assert first == a.video.expected(DATA)
        await a.stored(1)
        assert await b.answer(DATA, "VIDEO") == first
        assert await b.answer(DATA, "VIDEO") == first
        assert b.forwards == 0
        assert b.events.lookups == ["hit"], "the second was a hit in B's arena"


@pytest.mark.usefixtures("videos_are_their_bytes")
async def test_different_frame_samplings_never_share_an_entry() -> None:
    """Encoders sampling 2 and 4 frames a second share a store: neither is served the other's
    rows (each runs its forward); one sampling as the first does is served its entry."""
    client = FakeMooncake()
    async with (
        member("store", client=client) as two,
        member("store", fps=4.0, client=client) as four,
        member("store", client=client) as also_two,
    ):
        at_two = await two.answer(DATA, "VIDEO")
        await two.stored(1)
        at_four = await four.answer(DATA, "VIDEO")
        assert at_four == four.video.expected(DATA)
        assert at_four != at_two
        assert four.forwards == 1
        assert await also_two.answer(DATA, "VIDEO") == at_two
        assert also_two.forwards == 0


def _entry(client: FakeMooncake) -> str:
    (name,) = client.objects
    return name


@pytest.mark.usefixtures("videos_are_their_bytes")
@pytest.mark.parametrize("secret", [None, b"the fleet's secret"], ids=["unkeyed", "keyed"])
async def test_a_store_entry_whose_metadata_was_changed_is_never_served(
    secret: bytes | None,
) -> None:
    """The description between an entry's digest and its row (grid, metadata) is checked as
    the row is: one whose metadata was rewritten in place (same length, row untouched) is
    poisoned, removed and encoded again; the answer is the model's own."""
    client = FakeMooncake()
    async with (
        member("store", client=client, secret=secret) as a,
        member("store", client=client, secret=secret) as b,
    ):
        first = await a.answer(DATA, "VIDEO")
        await a.stored(1)
        name = _entry(client)
        entry = client.objects[name]
        description = entry[8 : 8 + _HEADER]
        assert b"second_per_grid_ts" in description
        forged = description.replace(b"second_per_grid_ts", b"second_per_grid_tt")
        client.objects[name] = entry[:8] + forged + entry[8 + _HEADER :]
        assert await b.answer(DATA, "VIDEO") == first
        assert b.events.lookups == ["poisoned"]
        assert b.forwards == 1, "encoded again"


@pytest.mark.usefixtures("videos_are_their_bytes")
@pytest.mark.parametrize("secret", [None, b"the fleet's secret"], ids=["unkeyed", "keyed"])
async def test_a_row_rewritten_beside_its_own_digest_and_description_is_never_served(
    secret: bytes | None,
) -> None:
    """Other row bytes under an entry's own digest and description (a write into the store's
    memory): the description still matches its digest, the row does not, so it is poisoned."""
    client = FakeMooncake()
    async with (
        member("store", client=client, secret=secret) as a,
        member("store", client=client, secret=secret) as b,
    ):
        first = await a.answer(DATA, "VIDEO")
        await a.stored(1)
        name = _entry(client)
        entry = client.objects[name]
        client.objects[name] = entry[: 8 + _HEADER] + b"\x07" * (len(entry) - 8 - _HEADER)
        assert await b.answer(DATA, "VIDEO") == first
        assert b.events.lookups == ["poisoned"]


@pytest.mark.usefixtures("videos_are_their_bytes")
async def test_a_forged_description_is_refused_under_a_fleet_secret() -> None:
    """Without the secret a stranger can write a description whose unkeyed tag is right
    (other metadata beside the fleet's own row): under a secret the tag is keyed, so it is
    poisoned, never served."""
    client = FakeMooncake()
    secret = b"the fleet's secret"
    async with (
        member("store", client=client, secret=secret) as a,
        member("store", client=client, secret=secret) as b,
    ):
        first = await a.answer(DATA, "VIDEO")
        await a.stored(1)
        name = _entry(client)
        entry = client.objects[name]
        body = _body((1, 2, 4), (("second_per_grid_ts", 9.0),))
        assert body is not None
        forged = _describe(None, name, entry[:8], body)
        client.objects[name] = entry[:8] + forged + entry[8 + _HEADER :]
        assert await b.answer(DATA, "VIDEO") == first
        assert b.events.lookups == ["poisoned"]


async def test_a_row_whose_description_does_not_fit_is_not_stored() -> None:
    """Metadata longer than an entry's description has room for is not cut: the put fails
    (counted), gives back what it held, and stores nothing."""
    client, events, given_back = FakeMooncake(), StoreEvents(), []
    store = MooncakeEmbeddingStore(
        master="127.0.0.1:1", segment_bytes=1 << 20, buffer_bytes=1 << 20, wait=1.0,
        observer=events,
    )  # fmt: skip
    store._client = client
    row = torch.zeros(2, 3)
    digest = _digest_bytes(tensor_checksum(row))
    long = (("video_timestamps", [0.5] * (_HEADER // 4)),)
    await store._put_now("long", row, digest, lambda: given_back.append(1), (1, 2, 4), long)
    await store._put_now("short", row, digest, None, (1, 2, 4), ())
    assert events.puts == ["failed", "stored"]
    assert given_back == [1]
    assert list(client.objects) == ["short"]


async def test_an_entry_of_the_previous_layout_is_never_read_as_one_of_this() -> None:
    """An entry of the earlier layout (digest, then row) under an item's name is not misread
    as a description and a row: the lookup fails and the forward runs."""
    client = FakeMooncake()
    async with member("store", client=client) as one:
        row = torch.full((2, 3), 40.0)
        data = row.view(torch.uint8).numpy().tobytes()
        key = content_key(one.encoder.model.model_id, DATA)
        client.objects[store_key("fake-model", key)] = xxhash.xxh3_64_digest(data) + data
        assert await one.answer(DATA, "IMAGE") == IMAGE_ANSWER
        assert one.events.lookups == ["error"]
        assert one.forwards == 1


@pytest.mark.usefixtures("videos_are_their_bytes")
async def test_an_image_and_a_video_of_the_same_bytes_in_flight_are_not_merged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An image queued for a forward is joined by a request for the same image, never by a
    request for the same bytes as a video: each modality gets its own job and its own rows."""
    model, video = Fingerprinted(), StandInVideo()
    settings = replace(SETTINGS, max_batch_wait=0.5)
    encoder = ImageEncoder(
        model, settings, run_decode=inline, run_forward=SlowForward(), video=cast(VideoPath, video)
    )
    got: dict[str, tuple[list[float], Media]] = {}

    async def request(name: str, modality: str) -> None:
        embedding = await encoder.encode([DATA], modality)
        got[name] = ([float(v) for v in embedding.tensor[:, 0]], embedding.media)

    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        async with trio.open_nursery() as requests:
            requests.start_soon(request, "image", "IMAGE")
            requests.start_soon(request, "video", "VIDEO")
            requests.start_soon(request, "image again", "IMAGE")
            await trio.sleep(0.1)
            assert len(encoder.batcher.in_flight) == 2, "one job per modality"
        nursery.cancel_scope.cancel()
    rows, _, media = video.expected(DATA)
    assert got == {
        "image": ([40.0, 40.0], Media()),
        "image again": ([40.0, 40.0], Media()),
        "video": (rows, media),
    }
    assert model.encoded == [40]
    assert len(video.forwarded) == 1


def test_a_video_part_routes_on_its_own_key() -> None:
    """A fleet client routes a part by its items and its modality: the same items as a video
    part and as an image part are other rows, ranked apart; an image part's key is unchanged."""
    items = ["https://example.invalid/a.mp4"]
    encoders = [f"http://10.0.0.{i}:8000" for i in range(1, 9)]
    assert content_digest(items, "IMAGE") == content_digest(items)
    assert content_digest(items, "VIDEO") != content_digest(items)
    assert content_digest(["VIDEO", *items]) != content_digest(items, "VIDEO")
    fleet = FleetClient(encoders)
    assert fleet.ranking(items, modality="VIDEO") == rank(encoders, content_digest(items, "VIDEO"))
    spread = {fleet.ranking([f"video-{n}"], modality="VIDEO")[0] for n in range(64)}
    assert len(spread) > 1
    assert {
        n
        for n in range(64)
        if fleet.ranking([f"v-{n}"], modality="VIDEO") != fleet.ranking([f"v-{n}"])
    }, "some video parts go elsewhere than image parts of the same items"


# -- a real video path ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"))


class Forwards:
    """An EncoderObserver that counts the items of each forward."""

    def __init__(self) -> None:
        self.items = 0

    def batch_finished(self, images: int, forward_seconds: float, ok: bool) -> None:
        self.items += images

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("arena_bytes", [0, 64 << 20], ids=["cache", "arena"])
async def test_a_repeated_video_of_a_real_model_is_a_hit_with_the_same_answer(
    qwen: Path, arena_bytes: int
) -> None:
    """The first answer carries Qwen2.5-VL's ``second_per_grid_ts``; the repeat runs no
    forward and answers the same rows, grid and metadata."""
    video = write_video(8, 4, 80, 48)
    forwards = Forwards()
    settings = EncoderSettings(
        model=qwen, warmup=False, cache_bytes=64 << 20, arena_bytes=arena_bytes
    )
    encoder = ImageEncoder.from_settings(settings, observer=forwards)
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        first = await encoder.encode([video], "VIDEO")
        again = await encoder.encode([video], "VIDEO")
        nursery.cancel_scope.cancel()
    assert forwards.items == 1, "the repeat is a hit"
    assert [name for name, _ in first.media.meta] == ["second_per_grid_ts"]
    assert again.media == first.media
    assert tuple(again.grids) == tuple(first.grids)
    assert again.checksum == first.checksum
    first.release()
    again.release()
