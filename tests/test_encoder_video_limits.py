"""The server's video settings reach the decoder, and videos decode in threads of their own.

A tiny random-weight Qwen2.5-VL serves through the encoder the service uses: each
``video_*`` limit set just under what a 2 s clip needs refuses it as a 413 naming the setting
(not a 400: the request was fine, only too big); and while videos hold every video decode
thread, another request's image is still decoded and encoded, because images have threads of
their own.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_encode.encoder import EncoderSettings, ImageEncoder
from trio_encode.encoder import batcher as batcher_module
from trio_encode.encoder.video import VideoLimits, decode_video
from trio_encode.errors import MediaTooLarge
from trio_encode.testing.images import noise_uri
from trio_encode.testing.tiny_vlm import save_tiny_model
from trio_encode.testing.videos import write_video

CLIP = write_video(8, 4, 80, 48)
"""2 s at 4 frames a second, 80x48: 4 frames chosen (SGLang's min_frames)."""
CLIP_PIXELS = 8 * 80 * 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"))


@asynccontextmanager
async def running(model_dir: Path, **settings: Any) -> AsyncIterator[ImageEncoder]:
    encoder = ImageEncoder.from_settings(EncoderSettings(model=model_dir, warmup=False, **settings))
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        yield encoder
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("video_max_seconds", 1.5),
        ("video_max_total_frames", 7),
        ("video_max_frame_pixels", 80 * 48 - 1),
        ("video_max_pixels", CLIP_PIXELS - 1),
        ("video_max_output_bytes", 4 * 80 * 48 * 3 - 1),
        ("video_decode_cpu_seconds", 1e-9),
    ],
)
async def test_each_video_limit_setting_refuses_a_clip_over_it_as_a_413(
    model_dir: Path, setting: str, value: float
) -> None:
    async with running(model_dir, **{setting: value}) as encoder:
        with pytest.raises(MediaTooLarge, match=rf"^mm_items\[0\]: .*\({setting}\)") as caught:
            await encoder.encode([CLIP], "VIDEO")
        assert (caught.value.status, caught.value.kind) == (413, "media_too_large")
    async with running(model_dir) as encoder:  # the shipped limits admit it
        embedding = await encoder.encode([CLIP], "VIDEO")
        assert embedding.rows > 0


def test_the_limits_are_the_settings() -> None:
    """Each limit is its own setting (none crossed with another), and the defaults are the
    same facts: VideoLimits takes its defaults from the settings' constants."""
    settings = EncoderSettings(
        video_max_seconds=1.0,
        video_max_total_frames=2,
        video_max_frame_pixels=3,
        video_max_pixels=4,
        video_max_output_bytes=5,
        video_decode_cpu_seconds=6.0,
    )
    assert VideoLimits.from_settings(settings) == VideoLimits(1.0, 2, 3, 4, 5, 6.0)
    assert VideoLimits.from_settings(EncoderSettings()) == VideoLimits()


class HeldDecodes:
    """Replaces the batcher's ``decode_video``: each call waits for :meth:`release` (then
    decodes), counting how many wait at once; ``held`` is set once ``count`` of them wait."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
        self.count = count
        self.inside = 0
        self.most = 0
        self.held = trio.Event()
        self._release = threading.Event()
        self._lock = threading.Lock()
        self._token = trio.lowlevel.current_trio_token()
        self._decode = decode_video
        monkeypatch.setattr(batcher_module, "decode_video", self._wait_then_decode)

    def _wait_then_decode(self, *args: Any) -> Any:
        with self._lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
            if self.inside == self.count:
                trio.from_thread.run_sync(self.held.set, trio_token=self._token)
        try:
            if not self._release.wait(timeout=30):
                raise AssertionError("never released")
            return self._decode(*args)
        finally:
            with self._lock:
                self.inside -= 1

    def release(self) -> None:
        self._release.set()


@pytest.mark.parametrize("threads", [1, 2])
async def test_an_image_is_served_while_videos_hold_every_video_thread(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """Three videos whose decodes wait until released: ``media_decode_threads`` of them
    decode at once, never more, and an image sent meanwhile is encoded before any is
    released. Were videos decoded in the images' two threads, two of them would hold both
    and the image would wait for them."""
    decodes = HeldDecodes(monkeypatch, threads)
    async with running(model_dir, media_decode_threads=threads) as encoder:
        done: list[str] = []

        async def video(name: str) -> None:
            await encoder.encode([CLIP + name.encode()], "VIDEO")  # distinct bytes each
            done.append(name)

        async with trio.open_nursery() as nursery:
            for name in ("a", "b", "c"):
                nursery.start_soon(video, name)
            try:
                await decodes.held.wait()
                with trio.fail_after(5):
                    image = await encoder.load_items([noise_uri(7)])
                    embedding = await encoder.encode(image)
                assert embedding.rows > 0
                assert done == []  # every video still held
                await trio.sleep(0.2)  # time for a third video to start, were it allowed to
                assert decodes.most == threads
            finally:
                decodes.release()  # the decode threads end either way
        assert sorted(done) == ["a", "b", "c"]


async def test_a_video_its_header_refuses_is_answered_while_the_video_thread_is_held(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Headers are read as videos arrive (in the images' threads), against the server's
    limits: a clip whose header declares more seconds than the setting gets its 413 while
    another video holds the one video decode thread."""
    decodes = HeldDecodes(monkeypatch, 1)
    async with (
        running(model_dir, video_max_seconds=1.5) as encoder,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(encoder.encode, [write_video(4, 4, 80, 48)], "VIDEO")  # 1 s
        try:
            await decodes.held.wait()
            with trio.fail_after(5), pytest.raises(MediaTooLarge, match=r"\(video_max_seconds\)"):
                await encoder.encode([CLIP], "VIDEO")
            assert decodes.inside == 1
        finally:
            decodes.release()
