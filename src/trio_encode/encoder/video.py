"""From a video's bytes to the frames SGLang's encoder would feed a Qwen-VL video processor.

SGLang's encode server decodes a video (torchcodec in its ``exact`` mode) and picks its frames
with Qwen-VL's rule: :func:`frame_count` frames at ``fps`` (2.0 by default), at least
``min_frames`` (4) and at most ``max_frames`` (768), a multiple of the temporal patch (2),
spread evenly from the first frame to the last (:func:`frame_indices`). The frame count and
average frame rate it samples by are those of the packets, not of the header: it reads every
packet once and counts them. :func:`decode_video` does the same walk with PyAV, so the same
indices select the same frames.

Everything a client sends is untrusted, and a video's cost follows what its container says:
the header's duration, frame count and frame size are checked against :class:`VideoLimits`
before anything is read past it (an MP4's sample table even before FFmpeg opens the file, as
FFmpeg indexes every sample a table declares), the packet walk (demuxing only, no decoding)
checks them again against what the packets say, and the output's size is checked before the
first frame is decoded. :func:`check_header` is the first of these steps alone, cheap enough
to run as a video arrives. A header that lies is caught where the truth shows: the walk
counts packets and their time span, the decode checks every frame's size against the declared
one, and a CPU-time budget backs up both. Only the containers and codecs named below are ever
opened: FFmpeg's other demuxers include playlists that open further files.

Pure and synchronous: each call opens its own container, so decode threads may run it at once.
"""

from __future__ import annotations

import bisect
import math
import struct
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from fractions import Fraction

import av
import av.container
import av.video.stream
import numpy as np
import numpy.typing as npt
from av.container import InputContainer

from trio_encode.encoder.containers import MATROSKA_MAGIC, declared_seconds, opened
from trio_encode.encoder.images import MediaKind
from trio_encode.encoder.settings import (
    VIDEO_DECODE_CPU_SECONDS,
    VIDEO_FPS,
    VIDEO_MAX_FRAME_PIXELS,
    VIDEO_MAX_FRAMES,
    VIDEO_MAX_OUTPUT_BYTES,
    VIDEO_MAX_PIXELS,
    VIDEO_MAX_SECONDS,
    VIDEO_MAX_TOTAL_FRAMES,
    VIDEO_MIN_FRAMES,
    EncoderSettings,
)
from trio_encode.errors import InvalidInput, MediaTooLarge

FRAME_FACTOR = 2
"""Frames are taken in multiples of this (the temporal patch of Qwen-VL's vision tower)."""


@dataclass(frozen=True)
class FrameSampling:
    """How many frames of a video go to the model: SGLang's settings and defaults (its encode
    server's ``vision_config.video``: ``fps``, ``min_frames``, ``max_frames``)."""

    fps: float = VIDEO_FPS
    """Frames taken per second of video."""
    min_frames: int = VIDEO_MIN_FRAMES
    """At least this many (rounded up to :data:`FRAME_FACTOR`), if the video has them."""
    max_frames: int = VIDEO_MAX_FRAMES
    """At most this many (rounded down to :data:`FRAME_FACTOR`)."""


@dataclass(frozen=True)
class VideoLimits:
    """What one video may cost, each checked from the header first and again as the truth
    shows: the server's ``video_*`` limit settings (:meth:`from_settings`; their docstrings
    say why the defaults are what they are). A refusal's message names the setting."""

    max_seconds: float = VIDEO_MAX_SECONDS
    """Duration, declared or spanned by the packets' timestamps (``video_max_seconds``)."""
    max_frames: int = VIDEO_MAX_TOTAL_FRAMES
    """Frames of the stream, declared or counted (``video_max_total_frames``)."""
    max_frame_pixels: int = VIDEO_MAX_FRAME_PIXELS
    """Width x height of one frame (``video_max_frame_pixels``)."""
    max_pixels: int = VIDEO_MAX_PIXELS
    """Frames x frame pixels of the whole stream (``video_max_pixels``)."""
    max_output_bytes: int = VIDEO_MAX_OUTPUT_BYTES
    """Bytes of the RGB frames returned, chosen frames x height x width x 3
    (``video_max_output_bytes``)."""
    budget_s: float = VIDEO_DECODE_CPU_SECONDS
    """CPU seconds of the calling thread for the whole call, walk and decode
    (``video_decode_cpu_seconds``). Thread time, not wall time: a decode waiting for a core is
    not the one being slow."""

    @classmethod
    def from_settings(cls, settings: EncoderSettings) -> VideoLimits:
        """The limits a server's settings set."""
        return cls(
            max_seconds=settings.video_max_seconds,
            max_frames=settings.video_max_total_frames,
            max_frame_pixels=settings.video_max_frame_pixels,
            max_pixels=settings.video_max_pixels,
            max_output_bytes=settings.video_max_output_bytes,
            budget_s=settings.video_decode_cpu_seconds,
        )


class VideoTooBig(MediaTooLarge):
    """A video is over one of :class:`VideoLimits`, by its header or by what its packets or
    frames turned out to be; the message names the limit."""


@dataclass(frozen=True)
class DecodedVideo:
    """The chosen frames and what SGLang's encoder reports of them."""

    frames: npt.NDArray[np.uint8]
    """(T, H, W, 3) RGB, in presentation order."""
    indices: tuple[int, ...]
    """The chosen frames' positions among all frames in presentation order (SGLang's
    ``frames_indices``)."""
    timestamps: tuple[float, ...]
    """The chosen frames' presentation times in seconds from the stream's first frame."""
    total_frames: int
    """Frames of the stream, counted by the packet walk (SGLang's ``total_num_frames``)."""
    fps: float
    """Average frame rate as SGLang's decoder computes it: frames over the packets' time
    span, or the header's rate where that span is zero."""
    codec: str
    width: int
    height: int

    @property
    def duration(self) -> float:
        """Seconds as SGLang reports them (``total_num_frames / fps``)."""
        return self.total_frames / self.fps


# The containers whose demuxers may see client bytes, by their magic; each is opened by name,
# so FFmpeg never probes with its other demuxers.
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot")
_TS_PACKET = 188
CONTAINER_NAMES = "MP4/MOV, WebM/Matroska or MPEG-TS"
VIDEO_ITEMS = MediaKind(
    "video",
    frozenset({"video/mp4", "video/quicktime", "video/webm", "video/x-matroska", "video/mp2t"}),
    frozenset({".mp4", ".m4v", ".mov", ".webm", ".mkv", ".ts"}),
    CONTAINER_NAMES,
    "video/mp4",
)
"""What a video ``mm_items`` entry may be (the container is checked from its bytes)."""

_SEEKABLE = frozenset({"mov", "matroska"})
"""Containers with an index to seek by; MPEG-TS is decoded from the start."""

CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg"})
"""The video decoders that may run on client bytes."""

# Thread CPU time, checked after every packet and frame; tests replace it.
_cpu_clock = time.thread_time


def frame_count(total_frames: int, video_fps: float, sampling: FrameSampling) -> int:
    """How many frames SGLang's Qwen-VL rule takes from a video of ``total_frames`` at
    ``video_fps``: ``total_frames / video_fps * fps``, clamped to ``[min_frames, max_frames]``
    (each rounded inwards to :data:`FRAME_FACTOR`) and to ``total_frames``, then rounded down
    to :data:`FRAME_FACTOR`. Raises :class:`InvalidInput` for a video too short to give
    :data:`FRAME_FACTOR` frames."""
    if video_fps <= 0 or not math.isfinite(video_fps):
        raise InvalidInput(f"the video has no usable frame rate ({video_fps})")
    low = math.ceil(sampling.min_frames / FRAME_FACTOR) * FRAME_FACTOR
    high = math.floor(sampling.max_frames / FRAME_FACTOR) * FRAME_FACTOR
    wanted = total_frames / video_fps * sampling.fps
    count = min(max(wanted, low), high, total_frames)
    count = math.floor(count / FRAME_FACTOR) * FRAME_FACTOR
    if not FRAME_FACTOR <= count <= total_frames:
        raise InvalidInput(
            f"the video has {total_frames} frames; at least {FRAME_FACTOR} are needed"
        )
    return count


def frame_indices(total_frames: int, video_fps: float, sampling: FrameSampling) -> list[int]:
    """The positions (in presentation order) of the frames SGLang's rule takes: evenly
    spaced from the first frame to the last, truncated to integers, duplicates dropped."""
    count = frame_count(total_frames, video_fps, sampling)
    spaced = np.linspace(0, total_frames - 1, num=count, dtype=np.int64)
    return [int(index) for index in np.unique(spaced)]


def video_timestamps(indices: list[int], fps: float, merge_size: int = 2) -> list[float]:
    """SGLang's ``video_timestamps`` for Qwen3-VL (and Qwen3.5): the chosen frames' times
    (``index / fps``), padded with the last to a multiple of ``merge_size`` and averaged over
    each group of ``merge_size``, first and last of the group."""
    times = [index / fps for index in indices]
    if times and len(times) % merge_size:
        times.extend([times[-1]] * (merge_size - len(times) % merge_size))
    return [
        (times[start] + times[start + merge_size - 1]) / 2
        for start in range(0, len(times), merge_size)
    ]


def second_per_grid_ts(sampling: FrameSampling, temporal_patch_size: int = 2) -> float:
    """SGLang's ``second_per_grid_ts`` for Qwen2.5-VL (and the Omni models): the temporal
    patch over the sampling rate setting, not the video's own rate."""
    return temporal_patch_size / sampling.fps


def check_header(data: bytes, limits: VideoLimits = VideoLimits()) -> None:
    """Refuse ``data`` from its container and header alone, as :func:`decode_video` does
    first, reading no packet: cheap enough to run as a video arrives, so a video its header
    already refuses is answered at once, not after the videos queued for decoding."""
    with _opened(data, _container_format(data, limits)) as container:
        _check_header(container, limits)


def decode_video(
    data: bytes,
    sampling: FrameSampling = FrameSampling(),
    limits: VideoLimits = VideoLimits(),
) -> DecodedVideo:
    """Decode the frames SGLang's rule takes from ``data``, refusing a video over ``limits``
    from its header before any packet is read, from its packets before any frame is decoded,
    and from its frames as they come. Every failure is an :class:`InvalidInput`."""
    container_format = _container_format(data, limits)
    started = _cpu_clock()
    with _opened(data, container_format) as container:
        header = _check_header(container, limits)
        walk = _walk(container, header, limits, started)
    total = len(walk.pts)
    indices = frame_indices(total, walk.fps, sampling)
    width, height = header.width, header.height
    size = len(indices) * height * width * 3
    if size > limits.max_output_bytes:
        raise VideoTooBig(
            f"the video's {len(indices)} chosen frames of {width}x{height} pixels are "
            f"{size} bytes as RGB; the limit is {limits.max_output_bytes} bytes "
            "(video_max_output_bytes)"
        )
    out = np.empty((len(indices), height, width, 3), dtype=np.uint8)
    chosen = [walk.pts[index] for index in indices]
    count = _Count(total, limits, started)
    seekable = container_format in _SEEKABLE
    slot = 0
    while slot < len(chosen):  # a second pass only after a seek that missed: then no seeks
        with _opened(data, container_format) as container:
            stream = container.streams.video[0]
            try:
                for frame in _frames_at(container, stream, chosen[slot:], walk, count, seekable):
                    if (frame.width, frame.height) != (width, height):
                        raise VideoTooBig(
                            f"the video declares frames of {width}x{height} pixels but has "
                            f"one of {frame.width}x{frame.height}; frames may not differ from "
                            "the declared size (video_max_frame_pixels)"
                        )
                    out[slot] = frame.to_ndarray(format="rgb24")
                    slot += 1
            except _SeekMissed:
                seekable = False
    first = walk.pts[0]
    return DecodedVideo(
        frames=out,
        indices=tuple(indices),
        timestamps=tuple(float((stamp - first) * walk.time_base) for stamp in chosen),
        total_frames=total,
        fps=walk.fps,
        codec=header.codec,
        width=width,
        height=height,
    )


def _opened(data: bytes, container_format: str) -> AbstractContextManager[InputContainer]:
    return opened(data, container_format, "video")


def _sniff(data: bytes) -> str:
    """The FFmpeg demuxer for ``data``, by its magic; refuse anything else."""
    if not data:
        raise InvalidInput("the video is empty")
    if data[4:8] in _MP4_BOXES:
        return "mov"
    if data.startswith(MATROSKA_MAGIC):
        return "matroska"
    if len(data) >= 2 * _TS_PACKET and data[0] == data[_TS_PACKET] == 0x47:
        return "mpegts"
    raise InvalidInput(f"the data is not a video in a known container: send {CONTAINER_NAMES}")


def _container_format(data: bytes, limits: VideoLimits) -> str:
    """The FFmpeg demuxer for ``data`` (:func:`_sniff`), after what must be checked before
    FFmpeg opens it (:func:`_check_sample_tables`)."""
    container_format = _sniff(data)
    if container_format == "mov":
        _check_sample_tables(data, limits)
    return container_format


_MP4_PARENTS = frozenset({b"moov", b"trak", b"mdia", b"minf", b"stbl"})


def _check_sample_tables(data: bytes, limits: VideoLimits) -> None:
    """Refuse an MP4/MOV with a track whose sample table, or whose fragments' runs (``trun``)
    together, declare more than ``max_frames`` samples, before FFmpeg opens it: FFmpeg indexes
    every sample of every track as it opens the file (tens of bytes each), and a table or a
    run of samples of one size declares any number of them in 20 bytes (a 2 KB file declaring
    60 million takes 2 GB and seconds to open). Audio FFmpeg indexes by chunk (PCM: one tick a
    sample) is not counted by samples. Only the first ``moov`` is read (FFmpeg skips others),
    and the boxes walked are bounded (four a frame: a file fragmented at every frame has two
    to four), so a file of millions of empty boxes costs this walk no more than an honest one."""
    boxes = _Boxes(data, 4 * limits.max_frames + 64)
    tables_read = False
    in_fragments: dict[bytes, int] = {}  # samples by track ID
    for kind, start, end in boxes.within(0, len(data)):
        if kind == b"moov" and not tables_read:
            tables_read = True
            for track_kind, track_start, track_end in boxes.within(start, end):
                if track_kind == b"trak":
                    handler, samples = _mp4_track_samples(boxes, track_start, track_end)
                    _check_samples(samples, f"{handler!r} track's sample table declares", limits)
        elif kind == b"moof":
            for fragment_kind, fragment_start, fragment_end in boxes.within(start, end):
                if fragment_kind != b"traf":
                    continue
                track = b""
                for run_kind, run_start, run_end in boxes.within(fragment_start, fragment_end):
                    if run_kind == b"tfhd":
                        track = data[run_start + 4 : run_start + 8]
                    elif run_kind == b"trun" and run_start + 8 <= run_end:
                        count = int.from_bytes(data[run_start + 4 : run_start + 8], "big")
                        in_fragments[track] = in_fragments.get(track, 0) + count
                        _check_samples(
                            in_fragments[track], "fragments declare, for one track,", limits
                        )


def _check_samples(samples: int, declared_by: str, limits: VideoLimits) -> None:
    if samples > limits.max_frames:
        raise VideoTooBig(
            f"the file's {declared_by} {samples} samples; the limit is {limits.max_frames} a "
            "track (video_max_total_frames)"
        )


def _mp4_track_samples(boxes: _Boxes, start: int, end: int) -> tuple[str, int]:
    """A ``trak`` box's handler (``vide``, ``soun``...) and the samples its table declares
    (``stsz`` or ``stz2``) as FFmpeg indexes them: 0 for audio whose ``stts`` is one run of
    one tick a sample, which FFmpeg indexes by chunk. Where boxes repeat, what counts most:
    the largest count, video if any handler says so, by chunk only if every ``stts`` says so."""
    data = boxes.data
    handlers: list[bytes] = []
    samples = 0
    by_chunk: bool | None = None
    stack = [(start, end)]
    while stack:
        for kind, box_start, box_end in boxes.within(*stack.pop()):
            field = data[box_start + 8 : box_start + 12]  # hdlr's type; stsz's, stz2's count
            if kind in _MP4_PARENTS:
                stack.append((box_start, box_end))
            elif kind == b"hdlr":
                handlers.append(field)
            elif kind in (b"stsz", b"stz2") and len(field) == 4:
                samples = max(samples, int.from_bytes(field, "big"))
            elif kind == b"stts" and box_start + 16 <= box_end:
                runs, _, delta = struct.unpack_from(">III", data, box_start + 4)
                by_chunk = (by_chunk is not False) and runs == 1 and delta == 1
    for named in (b"vide", b"soun", *handlers[:1]):
        if named in handlers:
            handler = named.decode("latin-1")
            break
    else:
        handler = "unnamed"
    return handler, 0 if handler == "soun" and by_chunk else samples


@dataclass
class _Boxes:
    """An MP4's boxes, of which at most ``left`` more may be walked (all walks together)."""

    data: bytes
    left: int

    def within(self, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
        """The boxes between ``start`` and ``end``: each one's type and its payload's bounds.
        A box whose size runs past ``end`` is cut at it; one whose size is impossible ends
        the walk (FFmpeg then refuses the file, or reads what it can)."""
        data, at = self.data, start
        while at + 8 <= end:
            self.left -= 1
            if self.left < 0:
                raise VideoTooBig(
                    "the file has more boxes than four a frame of the frame limit "
                    "(video_max_total_frames)"
                )
            size = int.from_bytes(data[at : at + 4], "big")
            kind = data[at + 4 : at + 8]
            header = 8
            if size == 1 and at + 16 <= end:
                size, header = int.from_bytes(data[at + 8 : at + 16], "big"), 16
            elif size == 0:
                size = end - at
            if size < header:
                return
            yield kind, at + header, min(at + size, end)
            at += size


@dataclass(frozen=True)
class _Header:
    stream: av.video.stream.VideoStream
    codec: str
    width: int
    height: int


def _check_header(container: av.container.InputContainer, limits: VideoLimits) -> _Header:
    """Refuse from what the container declares, before any packet is read."""
    if not container.streams.video:
        raise InvalidInput("the file has no video stream")
    stream = container.streams.video[0]
    codec = stream.codec_context.name
    if codec not in CODECS:
        raise InvalidInput(
            f"the video's codec {codec!r} is not accepted: send one of {', '.join(sorted(CODECS))}"
        )
    width, height = stream.codec_context.width, stream.codec_context.height
    pixels = width * height
    if width <= 0 or height <= 0:
        raise InvalidInput(f"the video declares no frame size ({width}x{height})")
    if pixels > limits.max_frame_pixels:
        raise VideoTooBig(
            f"the video declares frames of {width}x{height} pixels; the limit is "
            f"{limits.max_frame_pixels} pixels a frame (video_max_frame_pixels)"
        )
    seconds = declared_seconds(container, stream)
    if seconds is not None and seconds > limits.max_seconds:
        raise VideoTooBig(_over_seconds(f"declares {seconds:.1f}", limits))
    frames = stream.frames
    if frames <= 0 and seconds is not None and stream.guessed_rate:
        frames = math.ceil(seconds * float(stream.guessed_rate))
    _check_frames(frames, pixels, limits, "declares")
    return _Header(stream, codec, width, height)


def _over_seconds(what: str, limits: VideoLimits) -> str:
    return (
        f"the video {what} seconds; the limit is {limits.max_seconds:g} seconds (video_max_seconds)"
    )


def _check_frames(frames: int, pixels: int, limits: VideoLimits, verb: str) -> None:
    if frames > limits.max_frames:
        raise VideoTooBig(
            f"the video {verb} {frames} frames; the limit is {limits.max_frames} frames "
            "(video_max_total_frames)"
        )
    if frames * pixels > limits.max_pixels:
        raise VideoTooBig(
            f"the video {verb} {frames} frames of {pixels} pixels, {frames * pixels} in all; "
            f"the limit is {limits.max_pixels} pixels over all frames (video_max_pixels)"
        )


def _check_budget(started: float, limits: VideoLimits) -> None:
    if _cpu_clock() - started > limits.budget_s:
        raise VideoTooBig(
            f"the video took more than {limits.budget_s:g} CPU seconds to read; the limit is "
            f"{limits.budget_s:g} seconds (video_decode_cpu_seconds)"
        )


@dataclass(frozen=True)
class _Walk:
    """What the packets say: every frame's presentation time (sorted) and the keyframes'."""

    pts: list[int]
    keyframes: list[int]
    fps: float
    time_base: Fraction


def _walk(
    container: av.container.InputContainer, header: _Header, limits: VideoLimits, started: float
) -> _Walk:
    """Read every packet of the stream once (demuxing, no decoding), counting frames and
    their time span as SGLang's decoder does, and refuse at the first limit passed."""
    stream = header.stream
    pixels = header.width * header.height
    time_base = stream.time_base
    if time_base is None:
        raise InvalidInput("the video stream has no time base")
    pts: list[int] = []
    keyframes: list[int] = []
    begin: int | None = None
    end: int | None = None
    for packet in container.demux(stream):
        if packet.size == 0 or packet.is_discard:
            continue  # PyAV's flush packet at the end; packets the demuxer marks as dropped
        stamp = packet.pts if packet.pts is not None else packet.dts
        if stamp is None:
            raise InvalidInput("the video has a packet with no timestamp")
        pts.append(stamp)
        if packet.is_keyframe:
            keyframes.append(stamp)
        begin = stamp if begin is None else min(begin, stamp)
        end = max(end if end is not None else stamp, stamp + (packet.duration or 0))
        if len(pts) > limits.max_frames or len(pts) * pixels > limits.max_pixels:
            _check_frames(len(pts), pixels, limits, "has at least")
        span = float((end - begin) * time_base)
        if span > limits.max_seconds:
            raise VideoTooBig(_over_seconds(f"spans more than {span:.1f}", limits))
        _check_budget(started, limits)
    if not pts:
        raise InvalidInput("the video stream has no frames")
    assert begin is not None
    assert end is not None
    span = float((end - begin) * time_base)
    if span > 0:
        fps = len(pts) / span
    elif stream.guessed_rate:
        fps = float(stream.guessed_rate)
    else:
        raise InvalidInput("the video has no usable frame rate")
    pts.sort()
    keyframes.sort()
    return _Walk(pts, keyframes, fps, time_base)


class _SeekMissed(Exception):
    """A seek landed after the frame it was for (MPEG-TS and some damaged indexes)."""


@dataclass
class _Count:
    """Frames decoded across passes, bounded by the packet walk's count, and the budget."""

    packets: int
    limits: VideoLimits
    started: float
    decoded: int = 0
    fresh: int = 0
    """Frames later than any decoded before: a stream never shows more than its packets."""
    furthest: int | None = None

    def add(self, stamp: int) -> None:
        _check_budget(self.started, self.limits)
        if self.furthest is None or stamp > self.furthest:
            self.furthest = stamp
            self.fresh += 1
        self.decoded += 1
        # A seek may land before the furthest frame and decode some again: twice the count.
        if self.fresh > self.packets or self.decoded > 2 * self.packets:
            raise VideoTooBig(
                f"the video decoded to more than the {self.packets} frames its packets "
                "declare (video_max_total_frames)"
            )


def _frames_at(
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    chosen: list[int],
    walk: _Walk,
    count: _Count,
    seekable: bool,
) -> Iterator[av.VideoFrame]:
    """For each presentation time in ``chosen`` (ascending), the first decoded frame at or
    after it. Where ``seekable``, seeks to the keyframe before a chosen frame when that
    keyframe lies ahead of what has been decoded, and raises :class:`_SeekMissed` when a seek
    lands past its frame; otherwise decodes on from the start."""
    stream.codec_context.thread_count = 1  # the caller's thread is the one the budget times
    # libavcodec checks every frame's size against max_pixels before allocating it, so a frame
    # far over the limit, whatever the header said, is refused before it costs memory. It
    # counts padded sizes (an 80x48 H.264 frame fails at 3,840): twice the limit, and the exact
    # check against the declared size is the caller's.
    stream.codec_context.options = {"max_pixels": str(2 * count.limits.max_frame_pixels)}
    frames = container.decode(stream)
    position: int | None = None  # presentation time of the last frame decoded
    for target in chosen:
        sought = False
        if seekable:
            key_at = bisect.bisect_right(walk.keyframes, target) - 1
            keyframe = walk.keyframes[key_at] if key_at >= 0 else walk.pts[0]
            if position is None or position < keyframe or position > target:
                container.seek(keyframe, backward=True, any_frame=False, stream=stream)
                frames = container.decode(stream)
                sought = True
        while True:
            frame = next(frames, None)
            if frame is None:
                raise InvalidInput(
                    f"the video ended before its frame at {target} (its packets said "
                    f"{count.packets} frames)"
                )
            stamp = frame.pts if frame.pts is not None else frame.dts
            if stamp is None:
                raise InvalidInput("the video decoded a frame with no timestamp")
            count.add(stamp)
            if sought and stamp > target:
                raise _SeekMissed
            sought = False
            position = stamp
            if stamp >= target:
                yield frame
                break
