"""SGLang's ``AUDIO`` parts through the encoder the service uses: from a clip's bytes to the
embedding, its grids, the HTTP answers and the completion message its prefill rank gets.

A tiny random-weight Qwen2-Audio (audio only: it takes no images) and Qwen2.5-Omni thinker
(images and audio) serve WAV, FLAC and MP3 clips of several lengths and source rates written
by PyAV. A part's rows are, to the bit, the model's audio path run on its clips (a clip sent
alone: the path run on it alone); each clip's grid is ``(audio_feature_lens,)``, the log-mel
frames SGLang's encoder sends as the part's grid and its receiver flattens into
``audio_feature_lens``. Clips decode in the media threads, never in the images'; an image and
a clip of concurrent requests share a forward; a repeated clip is served again without one; a
model refuses a modality it has no path for before loading a byte of it.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import trio
from PIL import Image

from support.engines import RankEngines
from support.harness import http_server, landing_pools
from support.lifecycle_rig import landing_on
from support.sglang_pickle import Modality, safe_loads
from test_completion_notices import ScriptedPusher
from trio_encode.completion import Endpoint
from trio_encode.embedding import Embedding, RowsEmbedding
from trio_encode.encoder import EncoderSettings, ImageEncoder
from trio_encode.encoder import batcher as batcher_module
from trio_encode.encoder.audio import AudioLimits, decode_audio
from trio_encode.encoder.cache import content_key
from trio_encode.encoder.fingerprint import recipe_digest
from trio_encode.encoder.front import key_recipe
from trio_encode.encoder.loader import load_backend
from trio_encode.encoder.observer import NullEncoderObserver
from trio_encode.encoder.vlm_audio import AudioPath, PreparedAudio
from trio_encode.errors import InvalidInput, MediaTooLarge
from trio_encode.request_types import EmbeddingMemory, Media
from trio_encode.service import EncodeService, Notify, ServiceSettings
from trio_encode.testing.audio import write
from trio_encode.testing.images import noise_uri
from trio_encode.testing.memory_engine import InMemoryFabric
from trio_encode.testing.tiny_vlm import save_tiny_model

WAV = write("wav", 16_000, 1.0)
"""A second at the models' own rate: 100 frames, 25 tokens."""
FLAC = write("flac", 44_100, 2.5, channels=2)
"""Stereo at another rate, resampled and mixed to one channel."""
MP3 = write("mp3", 22_050, 0.7)
"""A lossy clip at a third rate, of a length that is no whole number of frames."""
CLIPS = (WAV, FLAC, MP3)
MEDIA_TYPES = {WAV: "audio/wav", FLAC: "audio/flac", MP3: "audio/mpeg"}
TOO_LONG = write("wav", 8_000, 31.0)
"""Past Qwen2-Audio's 30 s window (Qwen2.5-Omni's is 300 s)."""
T = TypeVar("T")
FAMILIES = ("qwen2_audio", "qwen2_5_omni")
SERVES = {"qwen2_audio": {"AUDIO"}, "qwen2_5_omni": {"IMAGE", "VIDEO", "AUDIO"}}


def uri(data: bytes) -> str:
    return f"data:{MEDIA_TYPES.get(data, 'audio/wav')};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2-Audio: audio only."""
    return save_tiny_model("qwen2_audio", tmp_path_factory.mktemp("qwen2_audio"))


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2.5-Omni (its thinker): images and audio."""
    return save_tiny_model("qwen2_5_omni", tmp_path_factory.mktemp("qwen2_5_omni"))


@pytest.fixture(params=FAMILIES)
def model_dir(request: pytest.FixtureRequest) -> Path:
    """Each audio family in turn (the module's own model of it)."""
    fixture = {"qwen2_audio": "audio_dir", "qwen2_5_omni": "omni_dir"}[str(request.param)]
    path: Path = request.getfixturevalue(fixture)
    return path


class Forwards(NullEncoderObserver):
    """Each forward's count of items, in order."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def batch_finished(self, images: int, forward_seconds: float, ok: bool) -> None:
        self.batches.append(images)


@asynccontextmanager
async def running(
    model_dir: Path, observer: Forwards | None = None, **settings: object
) -> AsyncIterator[ImageEncoder]:
    encoder = ImageEncoder.from_settings(
        EncoderSettings(model=model_dir, warmup=False, **settings),  # type: ignore[arg-type]
        observer=observer,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        yield encoder
        nursery.cancel_scope.cancel()


def audio_path(encoder: ImageEncoder) -> AudioPath:
    path = encoder.batcher.audio
    assert path is not None
    return path


def prepared(path: AudioPath, data: bytes) -> PreparedAudio:
    return path.prepare(decode_audio(data, path.sampling_rate))


def reference(path: AudioPath, data: bytes) -> torch.Tensor:
    """The rows of one clip by the model's audio path alone."""
    (rows,) = path.features([prepared(path, data)])
    return rows


def split(embedding: EmbeddingMemory) -> list[torch.Tensor]:
    assert isinstance(embedding, Embedding | RowsEmbedding)
    return list(torch.split(embedding.tensor, list(embedding.image_lens)))


async def test_a_part_of_clips_is_the_models_audio_path_to_the_bit(model_dir: Path) -> None:
    """Each clip's rows, token count and grid are its own; a second run of the part (a hit)
    answers the same."""
    async with running(model_dir) as encoder:
        path = audio_path(encoder)
        assert encoder.modalities == SERVES[path.model_type]
        items = await encoder.load_items([uri(data) for data in CLIPS], "AUDIO")
        assert items == list(CLIPS)
        embedding = await encoder.encode(items, "AUDIO")
        again = await encoder.encode(items, "AUDIO")
    clips = [prepared(path, data) for data in CLIPS]
    assert [clip.audio_feature_lens for clip in clips] == [100, 250, 70]  # 10 ms a frame
    assert tuple(embedding.image_lens) == tuple(clip.tokens for clip in clips)
    assert tuple(embedding.grids) == tuple((clip.audio_feature_lens,) for clip in clips)
    assert embedding.media == Media("AUDIO")  # the lengths are all SGLang's receiver reads
    # The part's clips share one forward, as they would in SGLang's encoder.
    for got, rows in zip(split(embedding), path.features(clips), strict=True):
        assert torch.equal(got, rows)
    for got, data in zip(split(embedding), CLIPS, strict=True):  # and each is its own alone
        assert torch.equal(got, reference(path, data))
    assert (again.media, tuple(again.grids)) == (embedding.media, tuple(embedding.grids))
    assert torch.equal(torch.cat(split(again)), torch.cat(split(embedding)))


async def test_a_clip_sent_alone_is_the_models_audio_path_alone_to_the_bit(
    model_dir: Path,
) -> None:
    async with running(model_dir) as encoder:
        path = audio_path(encoder)
        parts = [await encoder.encode([data], "AUDIO") for data in CLIPS]
    for part, data in zip(parts, CLIPS, strict=True):
        (got,) = split(part)
        assert torch.equal(got, reference(path, data))
        assert tuple(part.grids) == (prepared(path, data).grid,)


class HeldDecodes:
    """Replaces the batcher's ``decode_audio`` with one that waits until :meth:`release`;
    ``held`` is set once ``count`` decodes wait at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
        self.count = count
        self.inside = 0
        self.most = 0
        self.held = trio.Event()
        self._release = threading.Event()
        self._lock = threading.Lock()
        self._token = trio.lowlevel.current_trio_token()
        monkeypatch.setattr(batcher_module, "decode_audio", self._wait_then_decode)

    def _wait_then_decode(self, *args: Any) -> Any:
        with self._lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
            if self.inside == self.count:
                trio.from_thread.run_sync(self.held.set, trio_token=self._token)
        try:
            if not self._release.wait(timeout=30):
                raise AssertionError("never released")
            return decode_audio(*args)
        finally:
            with self._lock:
                self.inside -= 1

    def release(self) -> None:
        self._release.set()


@pytest.mark.parametrize("threads", [1, 2])
async def test_an_image_is_served_while_clips_hold_every_media_thread(
    omni_dir: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """Three clips whose decodes wait until released: ``media_decode_threads`` of them decode
    at once, never more, and an image sent meanwhile is encoded before any is released. Were
    clips decoded in the images' two threads, two of them would hold both and the image
    would wait for them."""
    decodes = HeldDecodes(monkeypatch, threads)
    async with running(omni_dir, media_decode_threads=threads) as encoder:
        done: list[str] = []

        async def clip(name: str) -> None:
            await encoder.encode([WAV + name.encode()], "AUDIO")  # distinct bytes each
            done.append(name)

        async with trio.open_nursery() as nursery:
            for name in ("a", "b", "c"):
                nursery.start_soon(clip, name)
            try:
                await decodes.held.wait()
                with trio.fail_after(5):
                    image = await encoder.load_items([noise_uri(7)])
                    embedding = await encoder.encode(image)
                assert embedding.rows > 0
                assert done == []  # every clip still held
                await trio.sleep(0.2)  # time for another clip to start, were it allowed to
                assert decodes.most == threads
            finally:
                decodes.release()  # the decode threads end either way
        assert sorted(done) == ["a", "b", "c"]


def image_rows(encoder: ImageEncoder, data: bytes) -> torch.Tensor:
    """The rows of one image by the model's image path alone."""
    model = encoder.model
    (rows,) = model.encode([model.decode(data, max_pixels=encoder.settings.max_image_pixels)])
    return rows


async def test_an_image_and_a_clip_of_concurrent_requests_share_a_forward(
    omni_dir: Path,
) -> None:
    """The batcher takes both requests' items into one forward (the queue holds two items; it
    would wait 30 s for more) and runs each through its own path: each gets its own rows."""
    image = noise_uri(3)
    forwards = Forwards()
    async with running(omni_dir, forwards, max_batch_size=2, max_batch_wait=30.0) as encoder:
        path = audio_path(encoder)
        got: dict[str, EmbeddingMemory] = {}

        async def encode(item: str, modality: str) -> None:
            got[modality] = await encoder.encode(
                await encoder.load_items([item], modality), modality
            )

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(encode, uri(FLAC), "AUDIO")
                nursery.start_soon(encode, image, "IMAGE")
        png = (await encoder.load_items([image]))[0]
    assert forwards.batches == [2]
    assert torch.equal(split(got["AUDIO"])[0], reference(path, FLAC))
    assert tuple(got["AUDIO"].grids) == ((250,),)
    assert got["AUDIO"].media.modality == "AUDIO"
    assert torch.equal(split(got["IMAGE"])[0], image_rows(encoder, png))
    assert got["IMAGE"].media.modality == "IMAGE"
    assert len(got["IMAGE"].grids[0] or ()) == 3  # image_grid_thw


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32)).save(out, format="PNG")
    return out.getvalue()


async def test_an_audio_model_refuses_an_image_part_before_loading_it(audio_dir: Path) -> None:
    refusal = r"^modality 'IMAGE' is not served by this model \(it serves AUDIO\)"
    async with running(audio_dir) as encoder:
        assert encoder.modalities == {"AUDIO"}
        with pytest.raises(InvalidInput, match=refusal) as refused:
            await encoder.load_items(["https://example.invalid/never-fetched.png"], "IMAGE")
        assert refused.value.status == 400
        with pytest.raises(InvalidInput, match=refusal):
            await encoder.encode([png()], "IMAGE")


@pytest.mark.parametrize("family", [None, "qwen2_5_vl"])
async def test_a_model_without_an_audio_path_refuses_an_audio_part_before_loading_it(
    family: str | None, tmp_path: Path
) -> None:
    """The built-in model and a VLM family with no audio path here."""
    model = None if family is None else save_tiny_model(family, tmp_path)
    encoder = ImageEncoder.from_settings(EncoderSettings(model=model, warmup=False))
    assert "AUDIO" not in encoder.modalities
    assert encoder.batcher.audio is None
    with pytest.raises(InvalidInput, match=r"^modality 'AUDIO' is not served by this model"):
        await encoder.load_items(["https://example.invalid/never-fetched.wav"], "AUDIO")


async def test_a_clip_that_is_not_one_is_a_400_naming_its_item(model_dir: Path) -> None:
    async with running(model_dir) as encoder:
        with pytest.raises(InvalidInput, match=r"^mm_items\[1\]: unsupported audio type"):
            await encoder.load_items([uri(WAV), noise_uri(1)], "AUDIO")
        with pytest.raises(InvalidInput, match=r"^mm_items\[1\]: the data is not audio") as bad:
            await encoder.encode([WAV, b"RIFF\x00\x00\x00\x00not audio at all"], "AUDIO")
        assert type(bad.value) is InvalidInput
        with pytest.raises(InvalidInput, match=r"^mm_items\[0\]: the audio could not be decoded"):
            await encoder.encode([WAV[:60]], "AUDIO")  # a WAV header and no samples


async def test_a_clip_over_the_decode_limits_is_a_413_naming_its_item(model_dir: Path) -> None:
    """The batcher decodes with the settings' :class:`AudioLimits`; a clip over one is refused
    as too large (413), not as malformed, and named with the setting."""
    async with running(model_dir, audio_max_seconds=2.0) as encoder:
        assert encoder.batcher.audio_limits == AudioLimits(max_seconds=2.0)
        with pytest.raises(
            MediaTooLarge,
            match=r"^mm_items\[1\]: the audio declares 2\.5 seconds.*\(audio_max_seconds\)",
        ):
            await encoder.encode([WAV, FLAC], "AUDIO")
        (rows,) = split(await encoder.encode([WAV], "AUDIO"))  # within them: served
    assert rows.shape[0] == 25


async def test_a_clip_past_qwen2_audios_window_is_a_413_naming_its_item(audio_dir: Path) -> None:
    async with running(audio_dir) as encoder:
        with pytest.raises(MediaTooLarge, match=r"^mm_items\[2\]: the audio is 31\.0 seconds") as e:
            await encoder.encode([WAV, MP3, TOO_LONG], "AUDIO")
    assert (e.value.status, e.value.kind) == (413, "media_too_large")


async def test_an_audio_parts_rank_is_told_its_modality_and_clip_lengths(model_dir: Path) -> None:
    """What SGLang's prefill rebuilds an audio part from: ``Modality.AUDIO`` and a grid of one
    length per clip (its receiver flattens it into ``audio_feature_lens``), in the completion
    message of its ``/send``; no video metadata."""
    fabric = InMemoryFabric()
    pusher = ScriptedPusher()
    rank = Endpoint("127.0.0.1", 41000)
    encoder = ImageEncoder.from_settings(EncoderSettings(model=model_dir, warmup=False))
    async with EncodeService.running(
        engine=fabric.engine("encoder"),
        encoder=encoder,
        settings=ServiceSettings(),
        pusher=pusher,
    ) as service:
        landing = await landing_on(fabric, "rank0", nbytes=1 << 20)
        report = await service.encode(
            "a_local_part_0", [uri(data) for data in CLIPS], receive_count=1, modality="AUDIO"
        )
        sent = await service.send("a_local_part_0", landing.receiver, notify=Notify(rank))
    assert sent.shape == report.shape
    (message,) = pusher.to(rank, "done")
    loaded = safe_loads(message)
    assert loaded.modality is Modality.AUDIO
    # A tensor of the clips' lengths, as SGLang's encoder sends it: its receiver calls
    # ``.flatten()`` on an audio part's grid (a list would end the rank's request).
    assert isinstance(loaded.grid_dim, torch.Tensor)
    assert loaded.grid_dim.dtype == torch.long
    assert loaded.grid_dim.flatten().tolist() == [100, 250, 70]
    assert not {"second_per_grid_ts", "video_timestamps"} & set(vars(loaded))
    assert loaded.shape == [report.shape.rows, report.shape.dim]
    path = audio_path(encoder)
    expected = torch.cat(path.features([prepared(path, data) for data in CLIPS]))
    assert landing.landed(report.shape.nbytes) == expected.numpy().tobytes()


async def test_the_http_answers_of_an_audio_part_carry_its_clip_lengths(
    model_dir: Path, rank_engines: RankEngines
) -> None:
    """The real server and a Mooncake receiver: ``/encode`` and the rank's metadata pull answer
    one ``[frames]`` grid per clip and the rows' shape; ``/send`` lands the rows; the run is
    timed under ``AUDIO``; a clip past a limit is a 413 naming its item."""
    encoder = ImageEncoder.from_settings(EncoderSettings(model=model_dir, warmup=False))
    encoder.batcher.audio_limits = AudioLimits(max_seconds=2.0)  # FLAC's 2.5 s are over
    path = audio_path(encoder)
    expected = torch.cat(path.features([prepared(path, data) for data in (WAV, MP3)]))
    async with (
        http_server(rank_engines.server, encoder=encoder) as harness,
        landing_pools(rank_engines, expected.numel() * 4 + 4096) as pools,
    ):
        with trio.fail_after(60):
            encoded = await harness.client.encode(
                "a_local_part_0", [uri(WAV), uri(MP3)], modality="AUDIO", num_parts=1, part_idx=0
            )
            pulled = await harness.client.post(
                "/scheduler_receive_meta_data", {"req_id": "a_local_part_0", "part_idx": 0}
            )
            slot = pools[0].allocate(encoded.embedding_size)
            await harness.client.send(
                "a_local_part_0", pools[0].session_id, slot.address, receive_count=1
            )
            with pytest.raises(MediaTooLarge, match=r"^mm_items\[1\]: the audio") as refused:
                await harness.client.encode(
                    "a_local_part_1", [uri(WAV), uri(FLAC)], modality="AUDIO", receive_count=1
                )
            await harness.settled()
            timed = await harness.value("encode_seconds_count", modality="AUDIO")
    for answer in (encoded.body, pulled):
        assert answer["grid_dim"] == [[100], [70]]
        assert answer["embedding_lens"] == [25, 17]
        assert (answer["embedding_len"], answer["embedding_dim"]) == tuple(expected.shape)
        assert answer["embedding_size"] == expected.numel() * 4
        assert not {"second_per_grid_ts", "video_timestamps"} & set(answer)
    assert encoded.body["modality"] == "AUDIO"
    assert torch.equal(slot.read(expected.shape[0], expected.shape[1], "float32"), expected)
    assert refused.value.status == 413
    assert timed == 1  # the refused run is not: only runs that return are timed


async def test_over_http_an_audio_model_refuses_an_image_part(
    audio_dir: Path, rank_engines: RankEngines
) -> None:
    encoder = ImageEncoder.from_settings(EncoderSettings(model=audio_dir, warmup=False))
    async with http_server(rank_engines.server, encoder=encoder) as harness:
        with trio.fail_after(30):
            with pytest.raises(InvalidInput, match="'IMAGE' is not served by this model") as e:
                await harness.client.encode("i_local_part_0", [noise_uri(5)], modality="IMAGE")
            await harness.settled()
    assert (e.value.status, e.value.kind) == (400, "invalid_input")


async def test_encoder_runs_are_timed_by_modality(omni_dir: Path) -> None:
    from trio_encode.server.metrics import Metrics

    metrics = Metrics()
    async with running(omni_dir) as encoder:
        timed = metrics.timed(encoder)
        await timed.encode([WAV], "AUDIO")
        await timed.encode([WAV, MP3], "AUDIO")
        await timed.encode(await encoder.load_items([noise_uri(4)]), "IMAGE")
    for modality, runs in (("AUDIO", 2), ("IMAGE", 1)):
        count = metrics.registry.get_sample_value(
            "trio_encode_encode_seconds_count", {"modality": modality}
        )
        assert count == runs, modality


async def test_a_repeated_clip_is_a_hit_without_a_second_forward(model_dir: Path) -> None:
    """A clip seen before (in this request or another) is served from the keeper with the
    first answer's rows and grid; only the new clip goes to a forward."""
    forwards = Forwards()
    async with running(model_dir, forwards) as encoder:
        first = await encoder.encode([WAV, MP3, WAV], "AUDIO")
        assert forwards.batches == [2]  # a clip repeated in a request is encoded once
        again = await encoder.encode([MP3, FLAC, WAV], "AUDIO")
    assert forwards.batches == [2, 1]  # FLAC alone
    rows = split(first)
    assert torch.equal(rows[0], rows[2])
    assert tuple(first.grids) == ((100,), (70,), (100,))
    hits = split(again)
    assert torch.equal(hits[0], rows[1])
    assert torch.equal(hits[2], rows[0])
    assert tuple(again.grids) == ((70,), (250,), (100,))
    assert again.media == Media("AUDIO")


async def test_a_clip_of_concurrent_requests_is_encoded_once(model_dir: Path) -> None:
    forwards = Forwards()
    async with running(model_dir, forwards, max_batch_wait=0.2) as encoder:
        got: list[EmbeddingMemory] = []

        async def encode() -> None:
            got.append(await encoder.encode([FLAC], "AUDIO"))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(encode)
    assert forwards.batches == [1]
    first, *others = (split(part)[0] for part in got)
    for rows in others:
        assert torch.equal(rows, first)
    assert {tuple(part.grids) for part in got} == {((250,),)}


def test_an_audio_clips_key_names_its_recipe(omni_dir: Path) -> None:
    """The same bytes are another entry as an image, and under an audio recipe resampled or
    padded otherwise: such rows never share one."""
    encoder = ImageEncoder.from_settings(EncoderSettings(model=omni_dir, warmup=False))
    path = audio_path(encoder)
    recipe = encoder.recipes["AUDIO"]
    assert recipe == key_recipe("AUDIO", None, path) == recipe_digest(path.recipe)
    assert recipe
    assert encoder.recipes["IMAGE"] == ""
    other_rate = AudioPath(path.vlm, path.model_type, path.extractor, path.extractor_kwargs, 8_000)
    padded = AudioPath(
        path.vlm, path.model_type, path.extractor, {"padding": "max_length"}, path.sampling_rate
    )
    model_id = encoder.model.model_id
    keys = {
        content_key(model_id, WAV, "AUDIO", recipe),
        content_key(model_id, WAV, "AUDIO", key_recipe("AUDIO", None, other_rate)),
        content_key(model_id, WAV, "AUDIO", key_recipe("AUDIO", None, padded)),
        content_key(model_id, WAV, "IMAGE", encoder.recipes["IMAGE"]),
    }
    assert len(keys) == 4


async def test_an_audio_only_model_warms_up_on_a_clip_of_silence(audio_dir: Path) -> None:
    """The warm-up forward of a model that takes no images is one second of silence through
    its audio path; the encoder is then ready and serves the path's rows."""
    seen: list[object] = []

    async def forward(fn: Callable[[], T]) -> T:
        seen.append(fn)
        return await trio.to_thread.run_sync(fn)

    settings = EncoderSettings(model=audio_dir, warmup=True)
    encoder = ImageEncoder(load_backend(settings), settings, run_forward=forward)
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        assert encoder.ready
        (warm_up,) = seen
        (rows,) = split(await encoder.encode([WAV], "AUDIO"))
        nursery.cancel_scope.cancel()
    assert isinstance(warm_up, partial)
    (blank,) = warm_up.args[0]
    assert isinstance(blank, PreparedAudio)
    assert blank.grid == (100,)
    assert torch.equal(rows, reference(audio_path(encoder), WAV))


async def test_a_clip_whose_header_understates_it_is_stopped_at_the_settings_limit(
    audio_dir: Path,
) -> None:
    """The header passes (it claims a second); the samples show more than
    ``audio_max_seconds`` while decoding: the decode runs under the settings' limits, not the
    defaults."""
    from hostile.audio import flac

    lying = flac(16_000, 1, 4.0, declared=16_000)
    async with running(audio_dir, audio_max_seconds=2.0) as encoder:
        with pytest.raises(
            MediaTooLarge,
            match=r"^mm_items\[0\]: the audio has more than [\d.]+ seconds; the limit is 2 "
            r"seconds \(audio_max_seconds\)",
        ):
            await encoder.encode([lying], "AUDIO")
