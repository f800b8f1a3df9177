"""What ``trio-encode bench`` runs: one frozen value, checked once when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trio_encode.encoder import EncoderSettings
from trio_encode.engine.mooncake import MooncakeSettings

ENCODER_TARGET = 0.9
"""The served/raw encoder throughput a serving path should keep."""


@dataclass(frozen=True)
class BenchConfig:
    """The measured rows; the defaults take about 5 minutes on 2 CPU cores."""

    encoder: EncoderSettings = field(default_factory=EncoderSettings)
    """The model and batching of the encoder rows (``max_batch_size`` is the B of both
    sides). The transfer rows use a stand-in model whose output has each exact size."""
    engine: MooncakeSettings = field(default_factory=MooncakeSettings)
    sizes: tuple[int, ...] = (400_000, 1_600_000, 6_400_000, 25_600_000)
    """Embedding sizes of the transfer rows, in bytes (rounded to whole 2048-float rows)."""
    tps: tuple[int, ...] = (1, 2, 4, 8)
    """Receiver ranks of the transfer rows: each rank sends every req_id in turn."""
    arena: tuple[bool, ...] = (True, False)
    """Served transfer rows with the registered arena, without it, or both."""
    peer: bool = True
    """Also time the asyncio peer (needs the ``bench`` extra: FastAPI and uvicorn)."""
    transfer_requests: int = 16
    """req_ids per round, size and TP; every rank sends each one."""
    concurrency: int = 16
    """HTTP clients calling /encode (then /send) in a loop, each with its own images."""
    encoder_rows: bool = True
    served_seconds: float = 60.0
    """Measured /encode time over all rounds."""
    raw_seconds: float = 15.0
    """Measured raw forward time over all rounds."""
    settle_seconds: float = 1.0
    """Per served encoder round, time for the clients to fill the pipeline first."""
    rounds: int = 3
    probe_interval: float = 0.05
    """Seconds between two /health probes."""
    load_nice: int = 0
    """Niceness added to the load process (0 measured faster than 10 on 2 cores)."""
    plots: Path | None = None
    """Directory to write the PNG plots into (none if unset)."""
    progress: bool = True
    """Report each phase on stderr while the bench runs."""

    def __post_init__(self) -> None:
        counts = {
            "transfer_requests": self.transfer_requests,
            "concurrency": self.concurrency,
            "rounds": self.rounds,
        }
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError("sizes must name at least one positive number of bytes")
        if not self.tps or min(self.tps) < 1:
            raise ValueError("tps must name at least one positive rank count")
        if not self.arena:
            raise ValueError("arena must be on, off, or both")
        for name, seconds in (
            ("served_seconds", self.served_seconds),
            ("raw_seconds", self.raw_seconds),
        ):
            if not seconds > 0:
                raise ValueError(f"{name} must be positive, got {seconds}")
        if not 0 <= self.load_nice <= 19:
            raise ValueError(f"load_nice must be in 0..19, got {self.load_nice}")
        if self.settle_seconds < 0 or not self.probe_interval > 0:
            raise ValueError("settle_seconds must be >= 0 and probe_interval positive")

    @property
    def encoder_tp(self) -> int:
        """Ranks the encoder rows' clients send to (they only end each scope)."""
        return min(4, max(self.tps))
