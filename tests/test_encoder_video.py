"""Videos are decoded to the frames SGLang's rule takes, and refused before the work a limit
guards: every video here is written in the test by PyAV itself, each frame marked with its
own index, so the frames that come back name themselves; lying containers are made by
editing the bytes of honest ones."""

from __future__ import annotations

import io
import math
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import av
import numpy as np
import numpy.typing as npt
import pytest

from hostile.videos import (
    fragment_bomb_mp4,
    fragmented_mp4,
    sample_table_bomb_mp4,
    webm_duration,
)
from trio_encode.encoder import video
from trio_encode.encoder.video import (
    DecodedVideo,
    FrameSampling,
    VideoLimits,
    VideoTooBig,
    check_header,
    decode_video,
    frame_count,
    frame_indices,
    second_per_grid_ts,
    video_timestamps,
)
from trio_encode.errors import InvalidInput
from trio_encode.testing.videos import write_video

BITS = 10  # frames are numbered in binary: one bar per bit, white for 1


def barcode(index: int, width: int, height: int) -> npt.NDArray[np.uint8]:
    """A frame that names ``index`` in bars wide enough to survive lossy codecs."""
    frame = np.zeros((height, width, 3), dtype=np.uint8)
    for bit in range(BITS):
        if index >> bit & 1:
            frame[:, bit * width // BITS : (bit + 1) * width // BITS] = 255
    return frame


def read_barcode(frame: npt.NDArray[np.uint8]) -> int:
    width = frame.shape[1]
    index = 0
    for bit in range(BITS):
        bar = frame[:, bit * width // BITS + 1 : (bit + 1) * width // BITS - 1]
        mean = float(bar.mean())
        assert mean < 40 or mean > 215, f"bar {bit} is neither black nor white ({mean})"
        index |= (mean > 128) << bit
    return index


def write(count: int, rate: int, width: int = 80, height: int = 48, **options: Any) -> bytes:
    """A video of barcoded frames (each names its index), as :func:`write_video` writes it."""
    return write_video(count, rate, width, height, **{"frame": barcode, **options})


def named(decoded: DecodedVideo) -> list[int]:
    return [read_barcode(frame) for frame in decoded.frames]


class Calls:
    """Counts calls to one of the module's steps, still doing the work."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.count = 0
        original = getattr(video, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(video, name, counted)


class DecodedFrames:
    """Counts the frames the decoder hands back (every one, chosen or stepped over)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = video._Count.add

        def add(count: video._Count, stamp: int) -> None:
            self.count += 1
            original(count, stamp)

        monkeypatch.setattr(video._Count, "add", add)


# -- the rule, by hand -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "fps", "sampling", "expected"),
    [
        # 95 frames at 24/s: 95 / 24 * 2 = 7.9 -> 6 (down to the temporal patch).
        (95, 24.0, FrameSampling(), [0, 18, 37, 56, 75, 94]),
        # 10 frames at 30/s: 0.67 wanted, raised to min_frames 4.
        (10, 30.0, FrameSampling(), [0, 3, 6, 9]),
        # 3 frames: min_frames 4 is more than there are; 3 rounds down to 2.
        (3, 30.0, FrameSampling(), [0, 2]),
        # 2 frames: both.
        (2, 1.0, FrameSampling(), [0, 1]),
        # 300 frames at 29.97/s: 20.02 -> 20, evenly from 0 to 299 and truncated.
        (300, 29.97, FrameSampling(), [math.floor(k * 299 / 19) for k in range(20)]),
        # min_frames 5 rounds up to 6; 20 frames at 30/s want 1.3.
        (20, 30.0, FrameSampling(min_frames=5), [0, 3, 7, 11, 15, 19]),
        # max_frames 7 rounds down to 6; 1000 frames at 10/s want 200.
        (1000, 10.0, FrameSampling(max_frames=7), [0, 199, 399, 599, 799, 999]),
        # A sampling rate above the video's own: all frames, capped at the frame count (odd:
        # rounded down to 2 x 5).
        (11, 5.0, FrameSampling(fps=30.0), [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]),
    ],
)
def test_frame_indices_follow_sglangs_rule(
    total: int, fps: float, sampling: FrameSampling, expected: list[int]
) -> None:
    assert frame_indices(total, fps, sampling) == expected
    assert frame_count(total, fps, sampling) == len(expected)


def test_frame_count_is_capped_at_max_frames() -> None:
    # An hour at 30/s wants 7,200 frames at 2/s: 768, SGLang's default cap.
    assert frame_count(108_000, 30.0, FrameSampling()) == 768
    indices = frame_indices(108_000, 30.0, FrameSampling())
    assert (indices[0], indices[-1], len(set(indices))) == (0, 107_999, 768)


@pytest.mark.parametrize(("total", "fps"), [(1, 30.0), (0, 30.0), (50, 0.0), (50, math.nan)])
def test_a_video_too_short_or_without_a_rate_is_refused(total: int, fps: float) -> None:
    with pytest.raises(InvalidInput):
        frame_indices(total, fps, FrameSampling())


def test_sglangs_video_metadata_by_hand() -> None:
    # Qwen3-VL: times of the chosen frames, in pairs, each pair's first and last averaged;
    # an odd count repeats the last.
    assert video_timestamps([0, 10, 20, 30], 10.0) == [0.5, 2.5]
    assert video_timestamps([0, 10, 20], 10.0) == [0.5, 2.0]
    assert video_timestamps([0, 4, 8, 12, 16, 20], 4.0, merge_size=3) == [1.0, 4.0]
    assert video_timestamps([0, 4, 8, 12], 4.0, merge_size=3) == [1.0, 3.0]  # 3 repeated twice
    # Qwen2.5-VL: the temporal patch over the sampling setting (not the video's own rate).
    assert second_per_grid_ts(FrameSampling()) == 1.0
    assert second_per_grid_ts(FrameSampling(fps=4.0), temporal_patch_size=2) == 0.5


# -- decoding --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "codec", "count", "rate", "size"),
    [
        ("mp4", "libx264", 95, 24, (80, 48)),
        ("mp4", "libx264", 41, 10, (160, 90)),
        ("mp4", "mpeg4", 61, 30, (96, 64)),
        ("webm", "libvpx-vp9", 95, 24, (80, 48)),
        ("webm", "libvpx", 50, 25, (120, 68)),
        ("matroska", "libx264", 33, 8, (64, 64)),
        ("mpegts", "libx264", 70, 30, (80, 48)),
    ],
)
def test_the_chosen_frames_come_back_in_order(
    fmt: str, codec: str, count: int, rate: int, size: tuple[int, int]
) -> None:
    width, height = size
    data = write(count, rate, width, height, fmt=fmt, codec=codec, gop=12)
    decoded = decode_video(data)
    assert decoded.total_frames == count
    # The frame rate is counted from the packets' time span, as SGLang's decoder counts it.
    # Matroska stores times in milliseconds, and its packets here carry no duration.
    assert decoded.fps == pytest.approx(rate, rel=0.02)
    expected = frame_indices(count, decoded.fps, FrameSampling())
    assert list(decoded.indices) == expected
    assert named(decoded) == expected
    assert decoded.frames.shape == (len(expected), height, width, 3)
    assert decoded.frames.dtype == np.uint8
    assert decoded.timestamps == pytest.approx([i / rate for i in expected], abs=1e-3)
    assert (decoded.width, decoded.height) == (width, height)
    assert decoded.duration == pytest.approx(count / decoded.fps)


@pytest.mark.parametrize("fmt", ["mp4", "matroska"])
def test_lossless_frames_come_back_byte_for_byte(fmt: str) -> None:
    rng = np.random.default_rng(7)
    images = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(30)]
    data = write(
        30,
        10,
        64,
        48,
        fmt=fmt,
        codec="libx264rgb",
        pix_fmt="rgb24",
        options={"crf": "0", "preset": "ultrafast"},
        frame=lambda index, width, height: images[index],
    )
    decoded = decode_video(data, FrameSampling(fps=4.0))
    assert list(decoded.indices) == frame_indices(30, 10.0, FrameSampling(fps=4.0))
    assert len(decoded.indices) == 12
    for frame, index in zip(decoded.frames, decoded.indices, strict=True):
        assert np.array_equal(frame, images[index])


def test_sampling_settings_change_the_frames() -> None:
    data = write(120, 30, gop=30)
    fewer = decode_video(data, FrameSampling(fps=1.0, min_frames=2))
    more = decode_video(data, FrameSampling(fps=10.0, max_frames=16))
    # 4 s at 1/s: 4 frames, evenly over 0..119.
    assert named(fewer) == list(fewer.indices) == [0, 39, 79, 119]
    assert len(more.indices) == 16
    assert named(more) == list(more.indices) == frame_indices(120, 30.0, FrameSampling(10, 4, 16))


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_seeking_skips_the_frames_between_keyframes(
    monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    codec = "libx264" if fmt == "mp4" else "libvpx-vp9"
    data = write(300, 30, fmt=fmt, codec=codec, gop=10)
    frames = DecodedFrames(monkeypatch)
    decoded = decode_video(data, FrameSampling(fps=0.5))
    # 10 s at 0.5/s: 5, rounded down to 4.
    assert named(decoded) == list(decoded.indices) == [0, 99, 199, 299]
    # Each chosen frame costs at most the frames from its keyframe (10 apart) to it; decoding
    # every frame up to the last chosen one would be 300.
    assert frames.count <= len(decoded.indices) * 10


def test_mpegts_is_decoded_from_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    # FFmpeg's MPEG-TS seek lands after the keyframe it is asked for: no seeks there.
    data = write(90, 30, fmt="mpegts", gop=10)
    frames = DecodedFrames(monkeypatch)
    decoded = decode_video(data)
    assert named(decoded) == list(decoded.indices)
    assert frames.count == decoded.indices[-1] + 1


def test_a_missed_seek_falls_back_to_decoding_from_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = write(120, 30, gop=10)
    real_seek = av.container.InputContainer.seek

    class Overshooting:
        """Every seek lands 25 frames (in a 1/15360 time base at 30/s) late."""

        def __init__(self, container: av.container.InputContainer) -> None:
            self.container = container

        def __getattr__(self, name: str) -> Any:
            return getattr(self.container, name)

        def seek(self, offset: int, **kwargs: Any) -> None:
            real_seek(self.container, offset + 25 * 512, **kwargs)

    original = video._frames_at

    def late(container: av.container.InputContainer, *args: Any) -> Iterator[av.VideoFrame]:
        return original(Overshooting(container), *args)  # type: ignore[arg-type]

    monkeypatch.setattr(video, "_frames_at", late)
    decoded = decode_video(data)
    assert named(decoded) == list(decoded.indices) == frame_indices(120, 30.0, FrameSampling())


def test_decoding_is_thread_safe() -> None:
    videos = [write(40 + 7 * n, 10 + n, 64 + 16 * n, 48, gop=5) for n in range(6)]
    alone = [named(decode_video(data)) for data in videos]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda data: named(decode_video(data)), videos * 3))
    assert together == alone * 3


# -- limits, before the work -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "named_limit"),
    [
        (VideoLimits(max_seconds=3.0), "video_max_seconds"),  # 95 frames at 24/s: 3.96 s
        (VideoLimits(max_frames=94), "video_max_total_frames"),
        (VideoLimits(max_frame_pixels=80 * 48 - 1), "video_max_frame_pixels"),
        (VideoLimits(max_pixels=95 * 80 * 48 - 1), "video_max_pixels"),
    ],
)
@pytest.mark.parametrize("fmt", ["mp4", "mov", "webm"])
def test_a_header_over_a_limit_is_refused_before_any_packet_is_read(
    monkeypatch: pytest.MonkeyPatch, limits: VideoLimits, named_limit: str, fmt: str
) -> None:
    codec = "libvpx-vp9" if fmt == "webm" else "libx264"
    data = write(95, 24, 80, 48, fmt=fmt, codec=codec)
    walks, decodes = Calls(monkeypatch, "_walk"), Calls(monkeypatch, "_frames_at")
    with pytest.raises(VideoTooBig, match=f"\\({named_limit}\\)") as caught:
        decode_video(data, limits=limits)
    assert caught.value.status == 413
    with pytest.raises(VideoTooBig, match=f"\\({named_limit}\\)"):
        check_header(data, limits)  # what the batcher asks as the video arrives
    assert (walks.count, decodes.count) == (0, 0)
    # At the limit itself, the same video passes.
    exact = {
        "video_max_seconds": VideoLimits(max_seconds=4.0),
        "video_max_total_frames": VideoLimits(max_frames=96),  # WebM: from 3.959 s at 24/s
        "video_max_frame_pixels": VideoLimits(max_frame_pixels=80 * 48),
        "video_max_pixels": VideoLimits(max_pixels=96 * 80 * 48),
    }[named_limit]
    check_header(data, exact)
    assert named(decode_video(data, limits=exact)) == [0, 18, 37, 56, 75, 94]


def test_chosen_frames_over_the_output_bytes_are_refused_before_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = write(95, 24, 80, 48)
    decodes = Calls(monkeypatch, "_frames_at")
    with pytest.raises(VideoTooBig, match=r"\(video_max_output_bytes\)"):
        decode_video(data, limits=VideoLimits(max_output_bytes=6 * 80 * 48 * 3 - 1))
    assert decodes.count == 0
    ok = decode_video(data, limits=VideoLimits(max_output_bytes=6 * 80 * 48 * 3))
    assert ok.frames.nbytes == 6 * 80 * 48 * 3


@pytest.mark.parametrize("track", [b"vide", b"soun"])
@pytest.mark.parametrize("fmt", ["mp4", "mov"])
def test_a_sample_table_declaring_millions_is_refused_before_ffmpeg_opens_it(
    monkeypatch: pytest.MonkeyPatch, fmt: str, track: bytes
) -> None:
    """3 KB declaring 60 million samples of one size in its video or its audio track, which
    FFmpeg would index as it opens the file (2.4 GB): refused from the table itself, FFmpeg
    never called."""
    data = sample_table_bomb_mp4(fmt=fmt, track=track)
    assert len(data) < 3000
    opens = Calls(monkeypatch, "_opened")
    expected = rf"{track.decode()}' track's sample table declares 60000000 samples.*\(video_"
    for refuse in (check_header, decode_video):
        with pytest.raises(VideoTooBig, match=expected):
            refuse(data)
    assert opens.count == 0
    # As many as the limit pass the tables' check (what FFmpeg finds then is for the others).
    at_limit = sample_table_bomb_mp4(samples=36_000, fmt=fmt, track=track)
    video._check_sample_tables(at_limit, VideoLimits(max_frames=36_000))


def test_a_fragment_declaring_millions_is_refused_before_ffmpeg_opens_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same in a fragmented MP4: 20 bytes of run (``trun``) declaring 60 million samples,
    which FFmpeg indexes as it opens the file (2.4 GB). The fragments of a track count
    together; an honest fragmented file decodes."""
    opens = Calls(monkeypatch, "_opened")
    with pytest.raises(VideoTooBig, match=r"fragments declare.* 60000000 samples.*\(video_"):
        check_header(fragment_bomb_mp4())
    assert opens.count == 0
    honest = fragmented_mp4(40)  # ten fragments, one from each keyframe
    video._check_sample_tables(honest, VideoLimits(max_frames=40))
    with pytest.raises(VideoTooBig, match=r"fragments declare, for one track, 40 samples"):
        video._check_sample_tables(honest, VideoLimits(max_frames=39))
    assert decode_video(honest).total_frames == 40


def box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I", len(body) + 8) + kind + body


@pytest.mark.parametrize(
    ("handlers", "deltas", "counted"),
    [
        ((b"soun",), (1,), False),  # PCM: FFmpeg indexes it by chunk
        ((b"soun",), (1024,), True),
        ((b"vide",), (1,), True),
        ((b"soun", b"vide"), (1,), True),  # two handlers: counted, whichever FFmpeg takes
        ((b"vide", b"soun"), (1,), True),
        ((b"soun",), (1, 1024), True),  # one of the time tables is not one tick a sample
        ((b"soun",), (1024, 1), True),
    ],
)
def test_a_track_is_counted_by_its_samples_unless_ffmpeg_indexes_it_by_chunk(
    handlers: tuple[bytes, ...], deltas: tuple[int, ...], counted: bool
) -> None:
    tables = [box(b"stts", struct.pack(">IIII", 0, 1, 60_000_000, delta)) for delta in deltas]
    sizes = box(b"stsz", struct.pack(">III", 0, 100, 60_000_000))
    track = box(
        b"trak",
        box(
            b"mdia",
            *(box(b"hdlr", struct.pack(">II", 0, 0), kind, bytes(12)) for kind in handlers),
            box(b"minf", box(b"stbl", *tables, sizes)),
        ),
    )
    data = box(b"ftyp", b"isom") + box(b"moov", track)
    if counted:
        with pytest.raises(VideoTooBig, match="declares 60000000 samples"):
            video._check_sample_tables(data, VideoLimits())
    else:
        video._check_sample_tables(data, VideoLimits())


def test_the_boxes_walked_before_ffmpeg_opens_a_file_are_bounded() -> None:
    """Four a frame of the frame limit, and 64 more: a file of millions of empty boxes is
    refused after that many, not walked to its end in Python."""
    limits = VideoLimits(max_frames=10)
    empty = struct.pack(">I4s", 8, b"free")
    video._check_sample_tables(empty * 104, limits)
    with pytest.raises(VideoTooBig, match=r"more boxes.*\(video_max_total_frames\)"):
        video._check_sample_tables(empty * 105, limits)
    with pytest.raises(VideoTooBig, match="more boxes"):
        check_header(empty * 8_000_000)  # 64 MB: refused after 144,064 of them


def test_pcm_audio_is_not_counted_by_its_samples() -> None:
    """Audio whose samples are one tick each (PCM) is indexed by chunk, not by sample: a
    minute of 48 kHz PCM in a MOV is not refused for its 2,880,000 samples."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mov") as container:
        stream = container.add_stream("libx264", rate=10)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuv420p"
        pcm = container.add_stream("pcm_s16le", rate=48000)
        assert isinstance(pcm, av.AudioStream)
        for index in range(600):
            image = av.VideoFrame.from_ndarray(barcode(index, 16, 16), format="rgb24")
            container.mux(stream.encode(image))
        for second in range(60):
            sound = av.AudioFrame.from_ndarray(
                np.zeros((1, 48000), np.int16), format="s16", layout="mono"
            )
            sound.sample_rate, sound.pts = 48000, second * 48000
            container.mux(pcm.encode(sound))
        container.mux(stream.encode())
        container.mux(pcm.encode())
    decoded = decode_video(buffer.getvalue(), limits=VideoLimits(max_frames=600))
    assert decoded.total_frames == 600


def test_a_tiny_file_claiming_hours_is_refused_from_its_header(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = webm_duration(write(95, 24, 80, 48, fmt="webm", codec="libvpx-vp9"), 3 * 3600e3)
    assert len(data) < 10_000
    walks = Calls(monkeypatch, "_walk")
    with pytest.raises(VideoTooBig, match=r"declares 10800\.0 seconds.*\(video_max_seconds\)"):
        decode_video(data)
    assert walks.count == 0


@pytest.mark.parametrize(
    ("limits", "named_limit"),
    [
        (VideoLimits(max_seconds=2.0), "video_max_seconds"),
        (VideoLimits(max_frames=50), "video_max_total_frames"),
        (VideoLimits(max_pixels=50 * 80 * 48), "video_max_pixels"),
    ],
)
def test_a_header_understating_the_stream_is_caught_by_the_packet_walk(
    monkeypatch: pytest.MonkeyPatch, limits: VideoLimits, named_limit: str
) -> None:
    # The WebM says 0.1 s (so about 3 frames at 24/s); its packets are 95 frames, 3.96 s.
    data = webm_duration(write(95, 24, 80, 48, fmt="webm", codec="libvpx-vp9"), 100.0)
    header = av.open(io.BytesIO(data), mode="r", format="matroska")
    assert header.duration == 100_000
    header.close()
    decodes = Calls(monkeypatch, "_frames_at")
    with pytest.raises(VideoTooBig, match=f"\\({named_limit}\\)"):
        decode_video(data, limits=limits)
    assert decodes.count == 0
    # What the packets say is what is sampled by, as SGLang's decoder does.
    honest = decode_video(data)
    assert honest.total_frames == 95
    assert named(honest) == [0, 18, 37, 56, 75, 94]


def test_a_frame_larger_than_declared_is_stopped_while_decoding() -> None:
    # Two MPEG-TS streams back to back (a legal concatenation): the header is the first's,
    # 64x48; frames of the second are 128x96.
    small = write(20, 10, 64, 48, fmt="mpegts")
    large = write(60, 10, 128, 96, fmt="mpegts")
    data = small + large
    header = av.open(io.BytesIO(data), mode="r", format="mpegts")
    assert (header.streams.video[0].width, header.streams.video[0].height) == (64, 48)
    header.close()
    with pytest.raises(
        VideoTooBig, match=r"64x48 pixels but has one of 128x96.*\(video_max_frame_pixels\)"
    ):
        decode_video(data)


def test_a_decode_past_its_budget_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reading of the CPU clock says another second has passed: the walk over 95
    packets stops at the budget's 30th second, long before the end of the stream."""
    data = write(95, 24)
    ticks = iter(range(10**6))
    monkeypatch.setattr(video, "_cpu_clock", lambda: float(next(ticks)))
    decodes = Calls(monkeypatch, "_frames_at")
    with pytest.raises(
        VideoTooBig, match=r"more than 30 CPU seconds.*\(video_decode_cpu_seconds\)"
    ):
        decode_video(data, limits=VideoLimits(budget_s=30.0))
    assert next(ticks) == 32  # the start, 31 packets, then this read
    assert decodes.count == 0


def test_the_budget_covers_the_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    data = write(95, 24, gop=200)  # one keyframe: every frame up to the last is decoded
    ticks = iter(range(10**6))
    monkeypatch.setattr(video, "_cpu_clock", lambda: float(next(ticks)))
    with pytest.raises(VideoTooBig, match=r"\(video_decode_cpu_seconds\)"):
        decode_video(data, limits=VideoLimits(budget_s=95 + 50))  # the walk takes 95 reads


# -- what is not a video ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "the video is empty"),
        (bytes(np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8)), "not a video"),
        (b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:///etc/passwd\n", "not a video"),
        (b"RIFF\x00\x10\x00\x00AVI LIST" + bytes(200), "not a video"),
        (b"\x00\x00\x00\x20ftypisom" + bytes(np.arange(3000, dtype=np.uint8)), "could not"),
        (b"\x1a\x45\xdf\xa3" + b"\x42\x86\x81\x01" + bytes(500), "could not"),
    ],
)
def test_garbage_is_refused_with_a_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(InvalidInput, match=message) as caught:
        decode_video(data)
    assert caught.value.status == 400


def test_a_truncated_mp4_is_refused() -> None:
    data = write(95, 24)  # the index (moov) is written last: half a file has none
    with pytest.raises(InvalidInput, match="could not be decoded"):
        decode_video(data[: len(data) // 2])


def test_a_truncated_webm_gives_the_frames_it_has() -> None:
    data = write(95, 24, fmt="webm", codec="libvpx-vp9", gop=10)
    decoded = decode_video(data[: len(data) * 2 // 3])
    assert 10 < decoded.total_frames < 95
    assert named(decoded) == list(decoded.indices)


def test_a_codec_outside_the_list_is_refused_before_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = write(20, 10, fmt="matroska", codec="ffv1", pix_fmt="yuv420p")
    walks = Calls(monkeypatch, "_walk")
    with pytest.raises(InvalidInput, match="codec 'ffv1' is not accepted"):
        decode_video(data)
    assert walks.count == 0


def test_a_file_without_video_is_refused() -> None:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        assert isinstance(stream, av.AudioStream)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.int16), layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with pytest.raises(InvalidInput, match="no video stream"):
        decode_video(buffer.getvalue())


def test_frames_past_the_packet_count_are_stopped() -> None:
    """The count behind the decode: never more new frames than packets, and never more than
    twice the packets in all (what seeks may decode again)."""
    count = video._Count(3, VideoLimits(), time.thread_time())
    for stamp in (10, 20, 30):
        count.add(stamp)
    with pytest.raises(VideoTooBig, match="more than the 3 frames"):
        count.add(40)
    again = video._Count(3, VideoLimits(), time.thread_time())
    for stamp in (10, 20, 30, 10, 20, 30):
        again.add(stamp)
    with pytest.raises(VideoTooBig, match="more than the 3 frames"):
        again.add(10)


def test_a_frame_over_the_pixel_limit_is_never_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The header says 64x48; frames of 256x192 follow, far over a limit of 10,000 pixels: the
    decoder itself refuses them (libavcodec's max_pixels), so none is ever handed back."""
    data = write(20, 10, 64, 48, fmt="mpegts") + write(60, 10, 256, 192, fmt="mpegts")
    sizes: set[tuple[int, int]] = set()
    original = video._frames_at

    def seen(*args: Any) -> Iterator[av.VideoFrame]:
        for frame in original(*args):
            sizes.add((frame.width, frame.height))
            yield frame

    monkeypatch.setattr(video, "_frames_at", seen)
    with pytest.raises(InvalidInput, match="could not be decoded"):
        decode_video(data, limits=VideoLimits(max_frame_pixels=10_000))
    assert sizes == {(64, 48)}


def test_packets_the_container_discards_are_not_frames() -> None:
    """An MP4 whose time-to-sample table stretches every frame to 125 s while its edit list
    still says 3.96 s: FFmpeg marks the packets past the edit as discarded, and SGLang's
    decoder (torchcodec) skips them, so the video is one frame long, too short to sample."""
    data = bytearray(write(95, 24, 80, 48))
    at = data.index(b"stts")
    assert struct.unpack_from(">II", data, at + 12) == (95, 512)  # one entry: 95 x 512
    struct.pack_into(">I", data, at + 16, 512 * 3000)
    with pytest.raises(InvalidInput, match="the video has 1 frames") as caught:
        decode_video(bytes(data))
    assert not isinstance(caught.value, VideoTooBig)
