"""What ``trio-encode bench`` found: the rows, their ratios, the table and the JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from trio_encode.tools.bench.settings import ENCODER_TARGET

if TYPE_CHECKING:
    from trio_encode.tools.bench.calls import CallsResult


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank rule; 0 for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0


def size_text(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass(frozen=True)
class Rate:
    """Bytes moved in seconds, pooled over the rounds."""

    nbytes: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TransferRow:
    """One embedding size at one TP: the same sends raw, served and through the peer."""

    nbytes: int
    """Bytes of one transfer (one req_id's embedding)."""
    tp: int
    arena: bool
    raw: Rate
    served: Rate
    peer: Rate | None
    registrations_per_request: float
    """From the server's ``/metrics`` over the served phases."""
    sends_per_rank: int = 0
    """Sends each rank made in each timed phase, over all rounds."""
    repeat_seconds: float | None = None
    """The served phases' sends made again, answered as repeats: every byte had already
    landed, so the same HTTP calls move nothing. What one ``/send`` costs besides the bytes."""

    @property
    def http_ms(self) -> float | None:
        """Milliseconds per ``/send`` of one rank that move no bytes (see ``repeat_seconds``)."""
        if self.repeat_seconds is None or self.sends_per_rank == 0:
            return None
        return 1000 * self.repeat_seconds / self.sends_per_rank

    @property
    def served_over_raw(self) -> float:
        return self.served.per_second / self.raw.per_second

    @property
    def served_over_peer(self) -> float | None:
        if self.peer is None or self.peer.per_second == 0:
            return None
        return self.served.per_second / self.peer.per_second


@dataclass(frozen=True)
class EncoderRow:
    batch_size: int
    concurrency: int
    raw_images: int
    raw_seconds: float
    served_images: int
    served_seconds: float
    served_batches: int
    served_forward_seconds: float
    """Time the forward pass ran during the served windows (from the batcher's observer)."""
    served_images_in_batches: int
    raw_spread: tuple[float, float]
    """Slowest and fastest raw images/s of the rounds (their gap shows the noise)."""
    served_spread: tuple[float, float]
    mean_image_bytes: float
    mean_tokens: float = 0.0
    """Image tokens (embedding rows) per image of the raw batch, the mix the clients send."""

    @property
    def raw_rate(self) -> float:
        return self.raw_images / self.raw_seconds

    @property
    def served_rate(self) -> float:
        return self.served_images / self.served_seconds

    @property
    def ratio(self) -> float:
        return self.served_rate / self.raw_rate

    @property
    def mean_batch(self) -> float:
        return self.served_images_in_batches / max(1, self.served_batches)

    @property
    def forward_busy(self) -> float:
        """Share of the served time the model ran (batches straddling a window's edges count
        whole, so it can read a little over 1)."""
        return self.served_forward_seconds / self.served_seconds

    @property
    def served_forward_rate(self) -> float:
        return self.served_images_in_batches / max(1e-9, self.served_forward_seconds)


@dataclass(frozen=True)
class VideoRow:
    """One video's ``VIDEO`` parts through the encoder the service uses (``load_items`` then
    ``encode``, from ``concurrency`` callers at once, batched up to ``batch_size`` videos)
    against the model's video path on the same prepared frames, one video a forward; and what
    decoding costs."""

    batch_size: int
    concurrency: int
    frames: int
    """Frames of the video the model takes (SGLang's sampling rule)."""
    tokens: int
    """Embedding rows of the video."""
    video_bytes: int
    raw_videos: int
    raw_seconds: float
    served_videos: int
    served_seconds: float
    served_batches: int
    served_videos_in_batches: int
    served_forward_seconds: float
    """Time the forward ran during the served phases (from the batcher's observer)."""
    decode_videos: int
    decode_seconds: float
    """``decode_video`` then ``prepare`` of the video, one after another, in the same rounds."""
    raw_spread: tuple[float, float]
    """Slowest and fastest raw frames/s of the rounds."""
    served_spread: tuple[float, float]

    @property
    def raw_frame_rate(self) -> float:
        return self.raw_videos * self.frames / self.raw_seconds

    @property
    def served_frame_rate(self) -> float:
        return self.served_videos * self.frames / self.served_seconds

    @property
    def ratio(self) -> float:
        return self.served_frame_rate / self.raw_frame_rate

    @property
    def mean_batch(self) -> float:
        return self.served_videos_in_batches / max(1, self.served_batches)

    @property
    def forward_busy(self) -> float:
        """Share of the served time the model ran."""
        return self.served_forward_seconds / self.served_seconds

    @property
    def decode_share(self) -> float:
        """One video's decoding time over the served time one video takes (the served time
        over the videos served). Decoding runs in worker threads beside the forward, so a
        share near or over 1 means decoding, not the model, bounds the served rate."""
        per_video = self.decode_seconds / self.decode_videos
        return per_video * self.served_videos / self.served_seconds


@dataclass(frozen=True)
class ProbeRow:
    interval: float
    probes: int
    ok: int
    p99_seconds: float
    max_seconds: float


@dataclass(frozen=True)
class BuildRow:
    """One embedding size at one TP: served /send of this build and of the baseline, each in a
    process of its own, alternating; CPU is each server process's, per transfer."""

    nbytes: int
    tp: int
    this: Rate
    baseline: Rate
    this_cpu_seconds: float
    baseline_cpu_seconds: float
    transfers: int
    """Transfers (req_ids x ranks) each side made, over all rounds."""
    this_rates: tuple[float, ...] = ()
    baseline_rates: tuple[float, ...] = ()
    """Bytes/s of each round."""

    @property
    def ratio(self) -> float:
        """This build's goodput over the baseline's."""
        return self.this.per_second / self.baseline.per_second

    def cpu_ms(self, seconds: float) -> float:
        return 1000 * seconds / self.transfers


@dataclass(frozen=True)
class BenchResult:
    model_id: str
    rounds: int
    torch_threads: int
    transfers: list[TransferRow]
    encoder: EncoderRow | None
    health: ProbeRow | None
    peak_rss_bytes: int
    registrations_left: int
    """Registrations the servers held at the end beyond their arenas (0 unless a leak)."""
    scopes_left: int
    seconds: float
    calls: CallsResult | None = None
    """The HTTP rows (``--http``)."""
    builds: list[BuildRow] = field(default_factory=list)
    """The /send rows against another build (``--baseline``)."""
    video: VideoRow | None = None
    """The ``VIDEO`` row (``--vlm``)."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.calls is not None:
            for route in sorted({row.route for row in self.calls.rows}):
                data["calls"].setdefault("ratios", {})[route] = self.calls.ratios(route)
        for build, out in zip(self.builds, data["builds"], strict=True):
            out["ratio"] = build.ratio
        for row, out in zip(self.transfers, data["transfers"], strict=True):
            out["served_over_raw"] = row.served_over_raw
            out["served_over_peer"] = row.served_over_peer
            out["http_ms"] = row.http_ms
        if self.encoder is not None:
            data["encoder"]["ratio"] = self.encoder.ratio
            data["encoder"]["mean_batch"] = self.encoder.mean_batch
        if self.video is not None:
            data["video"]["ratio"] = self.video.ratio
            data["video"]["decode_share"] = self.video.decode_share
            data["video"]["mean_batch"] = self.video.mean_batch
        return data

    def table(self) -> str:
        lines = [
            f"trio-encode bench: {self.rounds} alternating rounds, {self.seconds:.0f} s in all; "
            f"torch threads {self.torch_threads}",
        ]
        if self.transfers:
            lines += [
                "",
                "/send: every rank sends every req_id in turn; ranks and clients in a separate "
                "process",
                "  peer: an asyncio (FastAPI/uvicorn) model of SGLang's /send after its race fix; "
                "http ms: one rank's /send answered as a repeat (no bytes moved)",
                f"{'embedding':>10}{'TP':>4}{'arena':>7}{'raw':>12}{'served':>12}{'peer':>12}"
                f"{'served/raw':>12}{'served/peer':>13}{'reg/req':>9}{'http ms':>9}",
            ]
        for row in self.transfers:
            peer = f"{size_text(row.peer.per_second)}/s" if row.peer is not None else "-"
            over_peer = row.served_over_peer
            lines.append(
                f"{size_text(row.nbytes):>10}{row.tp:>4}{'on' if row.arena else 'off':>7}"
                f"{size_text(row.raw.per_second) + '/s':>12}"
                f"{size_text(row.served.per_second) + '/s':>12}{peer:>12}"
                f"{row.served_over_raw:>12.2f}"
                f"{'-' if over_peer is None else f'{over_peer:.2f}':>13}"
                f"{row.registrations_per_request:>9.2f}"
                f"{'-' if row.http_ms is None else f'{row.http_ms:.2f}':>9}"
            )
        e, h = self.encoder, self.health
        if e is not None:
            verdict = "meets" if e.ratio >= ENCODER_TARGET else "below"
            lines += [
                "",
                f"encoder {self.model_id}, B={e.batch_size}, {e.concurrency} clients: "
                f"raw {e.raw_rate:.1f} img/s, served {e.served_rate:.1f} img/s, "
                f"ratio {e.ratio:.2f} ({verdict} {ENCODER_TARGET})",
                f"  served: mean batch {e.mean_batch:.2f}, forward busy {e.forward_busy:.0%}, "
                f"forward alone {e.served_forward_rate:.1f} img/s; rounds raw "
                f"{e.raw_spread[0]:.1f}..{e.raw_spread[1]:.1f}, served "
                f"{e.served_spread[0]:.1f}..{e.served_spread[1]:.1f} img/s; JPEGs of "
                f"{size_text(e.mean_image_bytes)} on average",
            ]
            if e.mean_tokens:
                lines.append(
                    f"  tokens: {e.mean_tokens:.1f} per image; raw "
                    f"{e.raw_rate * e.mean_tokens:.0f} tokens/s, served "
                    f"{e.served_rate * e.mean_tokens:.0f} tokens/s"
                )
        if (v := self.video) is not None:
            verdict = "meets" if v.ratio >= ENCODER_TARGET else "below"
            lines += [
                "",
                f"video {self.model_id}, B={v.batch_size}, {v.concurrency} callers of encode("
                f"VIDEO): raw {v.raw_frame_rate:.1f} frames/s (one video a forward), served "
                f"{v.served_frame_rate:.1f} frames/s, ratio {v.ratio:.2f} ({verdict} "
                f"{ENCODER_TARGET})",
                f"  {v.frames} frames, {v.tokens} tokens a video ({size_text(v.video_bytes)} "
                f"MP4); raw {v.raw_frame_rate * v.tokens / v.frames:.0f} tokens/s, served "
                f"{v.served_frame_rate * v.tokens / v.frames:.0f} tokens/s; decoding "
                f"{v.decode_share:.0%} of the served time "
                f"({1000 * v.decode_seconds / v.decode_videos:.1f} ms a video); rounds raw "
                f"{v.raw_spread[0]:.1f}..{v.raw_spread[1]:.1f}, served "
                f"{v.served_spread[0]:.1f}..{v.served_spread[1]:.1f} frames/s",
                f"  served: mean batch {v.mean_batch:.2f} videos, forward busy "
                f"{v.forward_busy:.0%}",
            ]
        if h is not None:
            lines.append(
                f"/health every {h.interval * 1000:.0f} ms while encoding: {h.ok}/{h.probes} "
                f"answered 200, p99 {h.p99_seconds * 1000:.1f} ms, max "
                f"{h.max_seconds * 1000:.1f} ms"
            )
        if self.builds:
            lines += [
                "",
                "/send of this build against the baseline, each server in its own process "
                "(arena on), alternating rounds; CPU: the server process's per transfer",
                f"{'embedding':>10}{'TP':>4}{'this':>12}{'baseline':>12}{'ratio':>8}"
                f"{'rounds this':>26}{'rounds baseline':>26}{'ms CPU':>14}",
            ]
        for b in self.builds:
            rounds = [
                "/".join(f"{rate / 1e6:.0f}" for rate in rates)
                for rates in (b.this_rates, b.baseline_rates)
            ]
            cpu = f"{b.cpu_ms(b.this_cpu_seconds):.2f}/{b.cpu_ms(b.baseline_cpu_seconds):.2f}"
            lines.append(
                f"{size_text(b.nbytes):>10}{b.tp:>4}{size_text(b.this.per_second) + '/s':>12}"
                f"{size_text(b.baseline.per_second) + '/s':>12}{b.ratio:>8.2f}"
                f"{rounds[0] + ' MB/s':>26}{rounds[1] + ' MB/s':>26}{cpu:>14}"
            )
        if self.calls is not None:
            lines.append(self.calls.table())
        lines.append(
            f"memory: peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB; left at the end: "
            f"{self.registrations_left} registrations besides the arenas, "
            f"{self.scopes_left} scopes"
        )
        return "\n".join(lines)
