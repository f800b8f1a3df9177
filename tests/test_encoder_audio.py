"""Audio clips are decoded to mono float32 at the model's rate, and refused before the work a
limit guards: every clip here is written in the test by PyAV itself (a tone of known pitch, or
known samples), and lying files are made by editing the bytes of honest ones."""

from __future__ import annotations

import io
import struct
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import av
import numpy as np
import numpy.typing as npt
import pytest

from trio_encode.encoder import audio
from trio_encode.encoder.audio import AudioLimits, AudioTooLong, decode_audio
from trio_encode.errors import InvalidInput
from trio_encode.testing.audio import PITCH, tone, write


def pitch(samples: npt.NDArray[np.float32], rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.argmax(spectrum) * rate / len(samples))


def flac_total_samples(data: bytes, total: int) -> bytes:
    """The FLAC with its STREAMINFO's total samples (36 bits; 0: unknown) replaced."""
    at = 8 + 10  # "fLaC", the block header, block sizes and frame sizes
    assert data[:4] == b"fLaC"
    fields = int.from_bytes(data[at : at + 8], "big")
    fields = fields & ~((1 << 36) - 1) | total
    return data[:at] + fields.to_bytes(8, "big") + data[at + 8 :]


class Calls:
    """Counts calls to one of the module's steps, still doing the work."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.count = 0
        original = getattr(audio, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(audio, name, counted)


# -- decoding --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["wav", "flac", "mp3", "mp3-bare"])
@pytest.mark.parametrize("rate", [16_000, 22_050, 44_100, 8_000])
def test_a_clip_comes_back_mono_float32_at_the_models_rate(name: str, rate: int) -> None:
    decoded = decode_audio(write(name, rate, 2.0), 16_000)
    assert decoded.samples.dtype == np.float32
    assert decoded.samples.ndim == 1
    assert decoded.samples.flags.c_contiguous
    assert decoded.sampling_rate == 16_000
    assert (decoded.source_rate, decoded.channels) == (rate, 1)
    # Two seconds at 16 kHz: exact for the lossless formats; MP3's decoder trims its
    # encoder's delay and padding as the file's LAME header says, to within a frame; without
    # that header they stay (two frames at most).
    if name.startswith("mp3"):
        assert decoded.codec == "mp3float"
        frames = 2 if name == "mp3-bare" else 1
        assert abs(len(decoded.samples) - 32_000) <= frames * 1152 * 16_000 // rate
    else:
        assert len(decoded.samples) == 32_000
    assert decoded.duration == len(decoded.samples) / 16_000
    assert pitch(decoded.samples, 16_000) == pytest.approx(PITCH, abs=1.0)
    middle = decoded.samples[4000:-4000]
    assert float(np.abs(middle).max()) == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize(
    ("name", "rate", "codec", "slack"),
    [
        # AAC: its priming frame is trimmed by the MP4's edit list, its last frame's padding
        # is not; Opus: its pre-skip is trimmed, its last frame (20 ms) may be padded.
        ("m4a", 44_100, "aac", 2048),
        ("m4a", 16_000, "aac", 2048),
        ("webm", 48_000, "opus", 960),
        ("ogg", 48_000, "opus", 960),
        ("ogg", 16_000, "opus", 960),  # Opus decodes at 48 kHz whatever it was made from
    ],
)
def test_a_clip_in_a_compressed_container_comes_back(
    name: str, rate: int, codec: str, slack: int
) -> None:
    decoded = decode_audio(write(name, rate, 2.0), 16_000)
    assert decoded.codec == codec
    assert decoded.samples.dtype == np.float32
    source = 48_000 if codec == "opus" else rate
    assert 0 <= len(decoded.samples) - 32_000 <= slack * 16_000 // source
    assert pitch(decoded.samples, 16_000) == pytest.approx(PITCH, abs=1.0)
    middle = decoded.samples[4000:-4000]
    assert float(np.abs(middle).max()) == pytest.approx(0.5, abs=0.05)


def test_a_lossless_clip_at_the_models_rate_comes_back_sample_for_sample() -> None:
    rng = np.random.default_rng(3)
    samples = rng.uniform(-0.9, 0.9, (1, 12_345)).astype(np.float32)
    expected = np.round(samples[0] * 32767).astype(np.int16) / np.float32(32768)
    for name in ("wav", "flac"):
        decoded = decode_audio(write(name, 16_000, samples=samples), 16_000)
        assert np.array_equal(decoded.samples, expected.astype(np.float32))


def test_the_models_rate_is_the_one_asked_for() -> None:
    data = write("flac", 44_100, 1.5)
    for rate in (8_000, 16_000, 24_000, 48_000):
        decoded = decode_audio(data, rate)
        assert len(decoded.samples) == round(1.5 * rate)
        assert pitch(decoded.samples, rate) == pytest.approx(PITCH, abs=1.0)


def test_channels_are_mixed_to_one() -> None:
    # Left and right in phase: a tone; in opposite phase: silence. The mix is FFmpeg's.
    same = np.repeat(tone(16_000, 1.0), 2, axis=0)
    opposite = tone(16_000, 1.0, channels=2)
    mixed = decode_audio(write("wav", 16_000, samples=same), 16_000)
    cancelled = decode_audio(write("wav", 16_000, samples=opposite), 16_000)
    assert mixed.channels == cancelled.channels == 2
    assert float(np.abs(mixed.samples).max()) > 0.3
    assert float(np.abs(cancelled.samples).max()) < 1e-3


def test_decoding_is_thread_safe() -> None:
    clips = [
        write(name, rate, 0.5 + n / 4)
        for n, (name, rate) in enumerate(
            [("wav", 8_000), ("flac", 44_100), ("mp3", 22_050), ("mp3-bare", 16_000)] * 2
        )
    ]
    alone = [decode_audio(data, 16_000).samples for data in clips]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda data: decode_audio(data, 16_000).samples, clips * 3))
    for got, expected in zip(together, alone * 3, strict=True):
        assert np.array_equal(got, expected)


# -- limits, from the header before decoding -------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "named_limit", "exact"),
    [
        (AudioLimits(max_seconds=2.9), "max_seconds", AudioLimits(max_seconds=3.0)),
        (AudioLimits(max_channels=1), "max_channels", AudioLimits(max_channels=2)),
        # Three seconds at the model's 16 kHz: 48,000 float32 samples (MP3: 3.1 s declared).
        (
            AudioLimits(max_output_bytes=48_000 * 4 - 1),
            "max_output_bytes",
            AudioLimits(max_output_bytes=48_000 * 4),
        ),
        (
            AudioLimits(max_sample_rate=22_049),
            "max_sample_rate",
            AudioLimits(max_sample_rate=22_050),
        ),
    ],
)
@pytest.mark.parametrize("name", ["wav", "flac", "mp3", "m4a"])
def test_a_header_over_a_limit_is_refused_before_any_packet_is_decoded(
    monkeypatch: pytest.MonkeyPatch,
    limits: AudioLimits,
    named_limit: str,
    exact: AudioLimits,
    name: str,
) -> None:
    data = write(name, 22_050, 3.0, channels=2)
    decodes = Calls(monkeypatch, "_decode")
    with pytest.raises(AudioTooLong, match=f"declares .*\\((audio_)?{named_limit}\\)") as caught:
        decode_audio(data, 16_000, limits)
    assert caught.value.status == 413
    assert decodes.count == 0
    # At the limit itself, the same clip passes (MP3 and AAC declare a little over 3 s: their
    # encoders' delay and padding).
    if name in ("mp3", "m4a") and named_limit == "max_seconds":
        exact = AudioLimits(max_seconds=3.1)
    if name in ("mp3", "m4a") and named_limit == "max_output_bytes":
        exact = AudioLimits(max_output_bytes=round(3.1 * 16_000) * 4)
    assert len(decode_audio(data, 16_000, exact).samples) > 0
    assert decodes.count == 1


def test_a_tiny_file_claiming_hours_is_refused_from_its_header(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = flac_total_samples(write("flac", 16_000, 0.5), 3 * 3600 * 16_000)
    assert len(data) < 20_000
    decodes = Calls(monkeypatch, "_decode")
    with pytest.raises(AudioTooLong, match=r"declares 10800\.0 seconds.*\(audio_max_seconds\)"):
        decode_audio(data, 16_000)
    assert decodes.count == 0


# -- limits, while decoding ------------------------------------------------------------------


@pytest.mark.parametrize("declared", [16_000, 0], ids=["says-1s", "says-nothing"])
def test_more_samples_than_declared_are_stopped_with_bounded_memory(declared: int) -> None:
    """A FLAC of two minutes whose header says one second (or gives no length, as a stream
    that never ends would): stopped at the limit, holding no more than the limit's samples."""
    data = flac_total_samples(write("flac", 16_000, 120.0), declared)
    limits = AudioLimits(max_seconds=5.0)
    full = 120 * 16_000 * 4
    tracemalloc.start()
    try:
        with pytest.raises(
            AudioTooLong, match=r"has more than 5\.\d seconds.*\(audio_max_seconds\)"
        ):
            decode_audio(data, 16_000, limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    limit_bytes = 5 * 16_000 * 4
    assert peak < 3 * limit_bytes <= full // 8
    # The honest count: what the packets hold is what is decoded.
    assert decode_audio(data, 16_000).duration == 120.0


def test_a_clip_a_little_over_without_a_declared_length_is_stopped_while_decoding() -> None:
    data = flac_total_samples(write("flac", 16_000, 3.01), 0)
    with pytest.raises(AudioTooLong, match=r"has more than 3\.0 seconds.*\(audio_max_seconds\)"):
        decode_audio(data, 16_000, AudioLimits(max_seconds=3.0))
    assert decode_audio(data, 16_000, AudioLimits(max_seconds=3.01)).duration == 3.01


def test_output_over_its_bytes_is_stopped_while_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    data = flac_total_samples(write("flac", 16_000, 3.0), 0)  # no declared length
    decodes = Calls(monkeypatch, "_decode")
    # Three seconds at 48 kHz are 576,000 bytes of float32.
    with pytest.raises(AudioTooLong, match=r"has more than .*\(audio_max_output_bytes\)"):
        decode_audio(data, 48_000, AudioLimits(max_output_bytes=500_000))
    assert decodes.count == 1
    assert decode_audio(data, 48_000, AudioLimits(max_output_bytes=576_000)).samples.nbytes == (
        576_000
    )


def test_a_decode_past_its_budget_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reading of the CPU clock says another second has passed: the decode stops at the
    budget's 10th second, long before the end of the clip."""
    data = write("flac", 16_000, 30.0)
    ticks = iter(range(10**6))
    monkeypatch.setattr(audio, "_cpu_clock", lambda: float(next(ticks)))
    with pytest.raises(
        AudioTooLong, match=r"more than 10 CPU seconds.*\(audio_decode_cpu_seconds\)"
    ):
        decode_audio(data, 16_000, AudioLimits(budget_s=10.0))
    assert next(ticks) == 12  # the start, 11 frames, then this read


# -- what is not audio -----------------------------------------------------------------------


def _video() -> bytes:
    from trio_encode.testing.videos import write_video

    return write_video(4, 4, 32, 32)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "the audio is empty"),
        (bytes(np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8)), "not audio"),
        (b"#EXTM3U\n#EXTINF:10,\nfile:///etc/passwd\n", "not audio"),
        (b"RIFF\x00\x10\x00\x00AVI LIST" + bytes(200), "not audio"),
        (b"OggS" + bytes(300), "could not"),
        (b"\x00\x00\x00\x20ftypM4A " + bytes(np.arange(3000, dtype=np.uint8)), "could not"),
        (b"\x1a\x45\xdf\xa3" + b"\x42\x86\x81\x01" + bytes(500), "could not"),
        (b"fLaC" + bytes(np.arange(3000, dtype=np.uint8)), "could not"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(300), "could not|no sampling rate"),
        (b"ID3\x04\x00\x00\x00\x00\x00\x00" + bytes(500), "could not|no audio stream"),
    ],
)
def test_garbage_is_refused_with_a_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(InvalidInput, match=message) as caught:
        decode_audio(data, 16_000)
    assert caught.value.status == 400


def test_a_video_without_sound_has_no_audio_stream() -> None:
    with pytest.raises(InvalidInput, match="no audio stream"):
        decode_audio(_video(), 16_000)


def test_a_codec_outside_the_list_is_refused_before_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="wav") as container:
        stream = container.add_stream("adpcm_ima_wav", rate=16_000, layout="mono")
        assert isinstance(stream, av.AudioStream)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 4000), np.int16), layout="mono")
        frame.sample_rate = 16_000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    decodes = Calls(monkeypatch, "_decode")
    with pytest.raises(InvalidInput, match="codec 'adpcm_ima_wav' is not accepted"):
        decode_audio(buffer.getvalue(), 16_000)
    assert decodes.count == 0


def test_a_truncated_flac_gives_the_samples_it_has() -> None:
    data = write("flac", 16_000, 4.0)
    decoded = decode_audio(data[: len(data) // 2], 16_000)
    assert 0.5 < decoded.duration < 3.5


def test_a_clip_without_samples_is_refused() -> None:
    fmt = struct.pack("<HHIIHH", 1, 1, 16_000, 32_000, 2, 16)  # PCM, mono, 16 kHz, 16 bits
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", 0)
    data = b"RIFF" + struct.pack("<I", len(body)) + body
    with pytest.raises(InvalidInput, match="no samples"):
        decode_audio(data, 16_000)


def test_the_limits_are_the_settings() -> None:
    """Each audio setting reaches its limit, and the defaults are stated once."""
    from trio_encode.encoder import EncoderSettings

    assert AudioLimits.from_settings(EncoderSettings()) == AudioLimits()
    settings = EncoderSettings(
        audio_max_seconds=7.0, audio_max_output_bytes=12345, audio_decode_cpu_seconds=3.0
    )
    assert AudioLimits.from_settings(settings) == AudioLimits(
        max_seconds=7.0, max_output_bytes=12345, budget_s=3.0
    )
