"""From an audio clip's bytes to the samples SGLang's encoder feeds an audio model's feature
extractor: mono float32 at the model's sampling rate.

SGLang's loader (``load_audio``) decodes a WAV, FLAC, MP3 or Ogg clip with FFmpeg
(torchcodec's ``AudioDecoder``, asked for the model's rate and one channel) and a clip in an
MP4 (M4A) or WebM/Matroska container with PyAV; both convert with FFmpeg's own resampler
(libswresample, its default settings) to planar float32, one channel. :func:`decode_audio`
does the same with PyAV's ``AudioResampler`` (the same library, reached through FFmpeg's
filter graph, which inserts it with the same defaults), so a clip gives SGLang's samples
where both run the same FFmpeg. SGLang falls back to soundfile and torchaudio's resampler
where torchcodec is missing; its samples differ from FFmpeg's by resampling filter there, and
no attempt is made to follow it.

Everything a client sends is untrusted, and a clip's cost follows what its container says:
the header's duration (and the samples it makes at the model's rate), channels and sampling
rate are checked against :class:`AudioLimits` before any packet is read, and the decode
checks them again against what the samples turn out to be, frame by frame, so a header that
lies (a tiny file claiming hours, a stream that never ends, more samples than declared) is
stopped as soon as the truth passes a limit, with at most the limit's samples held. A
CPU-time budget backs up both. Only the containers and codecs named below are ever opened.
A packet the decoder refuses (a cut last frame) is skipped, as SGLang's PyAV path skips it;
a clip of which no packet decodes is refused.

Pure and synchronous: each call opens its own container, so decode threads may run it at once.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass

import av
import av.audio.stream
import av.container
import numpy as np
import numpy.typing as npt
from av.container import InputContainer

from trio_encode.encoder.containers import MATROSKA_MAGIC, declared_seconds, opened
from trio_encode.encoder.images import MediaKind
from trio_encode.encoder.settings import (
    AUDIO_DECODE_CPU_SECONDS,
    AUDIO_MAX_OUTPUT_BYTES,
    AUDIO_MAX_SECONDS,
    EncoderSettings,
)
from trio_encode.errors import InvalidInput, MediaTooLarge


@dataclass(frozen=True)
class AudioLimits:
    """What one clip may cost, each checked from the header first and again as the samples
    come. The defaults admit ten minutes of 7.1 sound at up to 192 kHz: far more than the
    audio models served take in one clip (Qwen2-Audio's window is 30 s), so a limit refuses
    only what no model would use."""

    max_seconds: float = AUDIO_MAX_SECONDS
    """Duration, declared or decoded (``audio_max_seconds``)."""
    max_channels: int = 8
    """Channels of the stream: each is decoded before the mix to one."""
    max_sample_rate: int = 192_000
    """The clip's own sampling rate: samples decoded per second of sound."""
    max_output_bytes: int = AUDIO_MAX_OUTPUT_BYTES
    """Bytes of the float32 samples returned (``audio_max_output_bytes``)."""
    budget_s: float = AUDIO_DECODE_CPU_SECONDS
    """CPU seconds of the calling thread for the whole call (``audio_decode_cpu_seconds``).
    Thread time, not wall time: a decode waiting for a core is not the one being slow."""

    @classmethod
    def from_settings(cls, settings: EncoderSettings) -> AudioLimits:
        """The limits a server's settings set (channels and sampling rate keep their
        defaults)."""
        return cls(
            max_seconds=settings.audio_max_seconds,
            max_output_bytes=settings.audio_max_output_bytes,
            budget_s=settings.audio_decode_cpu_seconds,
        )


class AudioTooLong(MediaTooLarge):
    """A clip is over one of :class:`AudioLimits` (or its model's window), by its header or
    by what its samples turned out to be; the message names the limit."""


@dataclass(frozen=True)
class DecodedAudio:
    """A clip's samples as SGLang's loader gives them, and what the file said of itself."""

    samples: npt.NDArray[np.float32]
    """Mono, float32, at :attr:`sampling_rate`, one dimension."""
    sampling_rate: int
    """Samples per second of :attr:`samples`: the rate the model's feature extractor takes."""
    codec: str
    source_rate: int
    """The clip's own sampling rate."""
    channels: int
    """The clip's own channels (mixed to one here)."""

    @property
    def duration(self) -> float:
        """Seconds of sound."""
        return len(self.samples) / self.sampling_rate


# The containers whose demuxers may see client bytes, by their magic; each is opened by name,
# so FFmpeg never probes with its other demuxers (some of which open further files).
_WAV_MAGIC = (b"RIFF", b"RF64")
_FLAC_MAGIC = b"fLaC"
_ID3_MAGIC = b"ID3"
_OGG_MAGIC = b"OggS"
_MP4_BOX = b"ftyp"
CONTAINER_NAMES = "WAV, FLAC, MP3, Ogg, MP4/M4A or WebM/Matroska"
AUDIO_ITEMS = MediaKind(
    "audio",
    frozenset(
        {
            "audio/wav",
            "audio/x-wav",
            "audio/wave",
            "audio/vnd.wave",
            "audio/flac",
            "audio/x-flac",
            "audio/mpeg",
            "audio/mp3",
            "audio/ogg",
            "audio/opus",
            "audio/mp4",
            "audio/x-m4a",
            "audio/webm",
            "audio/x-matroska",
        }
    ),
    frozenset({".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".m4a", ".mp4", ".webm", ".mka"}),
    CONTAINER_NAMES,
    "audio/wav",
)
"""What an audio ``mm_items`` entry may be (the container is checked from its bytes)."""

CODECS = frozenset(
    {
        "pcm_u8",
        "pcm_s16le",
        "pcm_s24le",
        "pcm_s32le",
        "pcm_f32le",
        "pcm_f64le",
        "pcm_alaw",
        "pcm_mulaw",
        "flac",
        "mp3",
        "mp3float",
        "aac",
        "opus",
        "vorbis",
    }
)
"""The audio decoders that may run on client bytes (FFmpeg's names)."""

# Thread CPU time, checked before every packet's decode; tests replace it.
_cpu_clock = time.thread_time


def decode_audio(
    data: bytes, sampling_rate: int, limits: AudioLimits = AudioLimits()
) -> DecodedAudio:
    """Decode ``data`` to mono float32 samples at ``sampling_rate``, refusing a clip over
    ``limits`` from its header before any packet is read, and from its samples as they come.
    Every failure is an :class:`InvalidInput` (:class:`AudioTooLong` for a limit)."""
    if sampling_rate <= 0:
        raise ValueError(f"sampling_rate must be positive, not {sampling_rate}")
    container_format = _sniff(data)
    started = _cpu_clock()
    with _opened(data, container_format) as container:
        header = _checked(container, sampling_rate, limits)
        samples = _decode(container, header, sampling_rate, limits, started)
    return DecodedAudio(samples, sampling_rate, header.codec, header.rate, header.channels)


def check_audio_header(
    data: bytes, sampling_rate: int, limits: AudioLimits = AudioLimits()
) -> None:
    """Refuse ``data`` from its container and header alone, as :func:`decode_audio` does
    first, reading no packet: cheap enough to run as a clip arrives, so a clip its header
    already refuses is answered at once, not after the clips queued for decoding."""
    with _opened(data, _sniff(data)) as container:
        _checked(container, sampling_rate, limits)


def _checked(
    container: av.container.InputContainer, sampling_rate: int, limits: AudioLimits
) -> _Header:
    """The header, refused over a limit it declares (the samples it would make included)."""
    header = _check_header(container, limits)
    if header.seconds is not None:
        _check_output(math.ceil(header.seconds * sampling_rate), "declares", limits)
    return header


def _opened(data: bytes, container_format: str) -> AbstractContextManager[InputContainer]:
    return opened(data, container_format, "audio")


def _sniff(data: bytes) -> str:
    """The FFmpeg demuxer for ``data``, by its magic; refuse anything else."""
    if not data:
        raise InvalidInput("the audio is empty")
    if data[:4] in _WAV_MAGIC and data[8:12] == b"WAVE":
        return "wav"
    if data.startswith(_FLAC_MAGIC):
        return "flac"
    if data.startswith(_ID3_MAGIC) or _is_mp3_frame(data):
        return "mp3"
    if data.startswith(_OGG_MAGIC):
        return "ogg"
    if data[4:8] == _MP4_BOX:
        return "mov"
    if data.startswith(MATROSKA_MAGIC):
        return "matroska"
    raise InvalidInput(f"the data is not audio in a known container: send {CONTAINER_NAMES}")


def _is_mp3_frame(data: bytes) -> bool:
    """Whether ``data`` opens with an MPEG audio frame header: 11 sync bits, a known version,
    layer III, a bit rate and a sampling rate that are not reserved values."""
    if len(data) < 4 or data[0] != 0xFF or data[1] & 0xE0 != 0xE0:
        return False
    version, layer = data[1] >> 3 & 0b11, data[1] >> 1 & 0b11
    bitrate, rate = data[2] >> 4, data[2] >> 2 & 0b11
    return version != 0b01 and layer == 0b01 and bitrate not in (0, 0xF) and rate != 0b11


@dataclass(frozen=True)
class _Header:
    stream: av.audio.stream.AudioStream
    codec: str
    rate: int
    channels: int
    seconds: float | None
    """The declared duration, where the container declares one."""


def _check_header(container: av.container.InputContainer, limits: AudioLimits) -> _Header:
    """Refuse from what the container declares, before any packet is read."""
    if not container.streams.audio:
        raise InvalidInput("the file has no audio stream")
    stream = container.streams.audio[0]
    codec = stream.codec_context.name
    if codec not in CODECS:
        raise InvalidInput(
            f"the audio's codec {codec!r} is not accepted: send one of {', '.join(sorted(CODECS))}"
        )
    rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
    if rate <= 0 or channels <= 0:
        raise InvalidInput(f"the audio declares no sampling rate or channels ({rate}, {channels})")
    _check_format(rate, channels, limits, "declares")
    seconds = declared_seconds(container, stream)
    if seconds is not None and seconds > limits.max_seconds:
        raise AudioTooLong(_over_seconds(f"declares {seconds:.1f}", limits))
    return _Header(stream, codec, rate, channels, seconds)


def _check_format(rate: int, channels: int, limits: AudioLimits, verb: str) -> None:
    if channels > limits.max_channels:
        raise AudioTooLong(
            f"the audio {verb} {channels} channels; the limit is {limits.max_channels} "
            "channels (max_channels)"
        )
    if rate > limits.max_sample_rate:
        raise AudioTooLong(
            f"the audio {verb} {rate} samples a second; the limit is "
            f"{limits.max_sample_rate} (max_sample_rate)"
        )


def _over_seconds(what: str, limits: AudioLimits) -> str:
    return (
        f"the audio {what} seconds; the limit is {limits.max_seconds:g} seconds (audio_max_seconds)"
    )


def _decode(
    container: av.container.InputContainer,
    header: _Header,
    sampling_rate: int,
    limits: AudioLimits,
    started: float,
) -> npt.NDArray[np.float32]:
    """Every frame of the stream through FFmpeg's resampler to mono float32 at
    ``sampling_rate``, refusing at the first limit the samples pass: the samples held are
    counted as they come out of the resampler, so no more than a limit's worth (and one
    frame) is ever held, whatever the header said."""
    stream = header.stream
    stream.codec_context.thread_count = 1  # the caller's thread is the one the budget times
    resampler = av.AudioResampler(format="fltp", layout="mono", rate=sampling_rate)
    most = min(
        limits.max_output_bytes // 4,
        math.ceil(limits.max_seconds * sampling_rate) + _RESAMPLER_SLACK,
    )
    chunks: list[npt.NDArray[np.float32]] = []
    held = 0
    skipped: av.FFmpegError | None = None

    def keep(frames: list[av.AudioFrame]) -> None:
        nonlocal held
        for out in frames:
            chunk = np.asarray(out.to_ndarray(), dtype=np.float32).reshape(-1)
            held += len(chunk)
            if held > most:
                _check_output(held, "has more than", limits)
                raise AudioTooLong(
                    _over_seconds(f"has more than {held / sampling_rate:.1f}", limits)
                )
            chunks.append(chunk)

    try:
        for packet in container.demux(stream):
            _check_budget(started, limits)
            try:
                frames = packet.decode()
            except av.FFmpegError as exc:
                skipped = skipped or exc
                continue  # see the module's docstring: a damaged packet is skipped
            for frame in frames:
                _check_format(frame.sample_rate, frame.layout.nb_channels, limits, "has")
                keep(resampler.resample(frame))
        keep(resampler.resample(None))
    except av.FFmpegError as exc:
        raise InvalidInput(f"the audio could not be decoded: {exc}") from None
    except ValueError as exc:  # PyAV's resampler: a frame unlike the first (rate, layout)
        raise InvalidInput(f"the audio changes format midway: {exc}") from None
    if not held:
        reason = f": {skipped}" if skipped else ""
        raise InvalidInput(f"the audio has no samples{reason}")
    return np.ascontiguousarray(np.concatenate(chunks), dtype=np.float32)


_RESAMPLER_SLACK = 1
"""Samples the resampler may hand back past the input's duration times the rate (its
rounding)."""


def _check_output(samples: int, verb: str, limits: AudioLimits) -> None:
    """Refuse ``samples`` float32 samples at the model's rate over ``max_output_bytes``."""
    if samples * 4 > limits.max_output_bytes:
        raise AudioTooLong(
            f"the audio {verb} {samples} samples at the model's rate, {samples * 4} bytes; the "
            f"limit is {limits.max_output_bytes} bytes (audio_max_output_bytes)"
        )


def _check_budget(started: float, limits: AudioLimits) -> None:
    if _cpu_clock() - started > limits.budget_s:
        raise AudioTooLong(
            f"the audio took more than {limits.budget_s:g} CPU seconds to decode; the limit is "
            f"{limits.budget_s:g} seconds (audio_decode_cpu_seconds)"
        )
