"""What ``trio-encode bench`` runs: one frozen value, checked once when it is built.

Each field is declared with :func:`~trio_encode.declare.setting`, so it is also a flag of
``trio-encode bench`` (flags only: a benchmark is not configured from the environment).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field
from pydantic.dataclasses import dataclass

from trio_encode.declare import SETTINGS, comma_separated, in_group
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.engine.mooncake import MooncakeSettings
from trio_encode.sizes import ByteSize

ENCODER_TARGET = 0.9
"""The served/raw encoder throughput a serving path should keep."""
FLOOR_TARGET = 1.3
"""The most server CPU per call (pulls, /send, /health) ours may cost over the floor's (hypercorn
with a one-line ASGI app)."""
PEER_TARGET = 0.5
"""The least calls/s (pulls, /send, /health) ours should answer against the SGLang-style server."""

ArenaMode = Literal["both", "on", "off"]
_ARENA_MODES: dict[str, tuple[bool, ...]] = {"both": (True, False), "on": (True,), "off": (False,)}


Sizes = Annotated[
    tuple[Annotated[ByteSize, Field(gt=0)], ...],
    BeforeValidator(comma_separated),
    Field(min_length=1),
]
Counts = Annotated[
    tuple[Annotated[int, Field(gt=0)], ...], BeforeValidator(comma_separated), Field(min_length=1)
]


bench_setting = in_group("bench")


@dataclass(frozen=True, config=SETTINGS)
class BenchConfig:
    """The measured rows; the defaults take about 5 minutes on 2 CPU cores."""

    encoder: EncoderSettings = Field(default_factory=EncoderSettings)
    """The model and batching of the encoder rows (``max_batch_size`` is the B of both
    sides). The transfer rows use a stand-in model whose output has each exact size."""
    engine: MooncakeSettings = Field(default_factory=MooncakeSettings)
    sizes: Sizes = bench_setting((400_000, 1_600_000, 6_400_000, 25_600_000))
    """Embedding sizes of the /send rows, comma-separated, with units (e.g. 0.4MB,1.6MB); rounded to
    whole 2048-float rows."""
    tps: Counts = bench_setting((1, 2, 4, 8))
    """Receiving ranks of the /send rows, each with its own engine; every rank sends every req_id in
    turn."""
    arena: ArenaMode = bench_setting("both")
    """Served /send rows with the registered arena, without it, or both."""
    peer: bool = bench_setting(True)
    """Also time the asyncio peer (needs the bench extra: FastAPI and uvicorn)."""
    transfer_requests: int = bench_setting(32, gt=0)
    """req_ids per round, size and TP; every rank sends each."""
    encoder_rows: bool = bench_setting(True)
    """Also measure /encode against the model's forward."""
    vlm: bool = bench_setting(False)
    """Only the encoder rows, on a small Qwen2.5-VL-shaped model with random weights (built into a
    temporary directory, nothing downloaded) and images of four sizes and aspect ratios; the row
    adds tokens/s. Then a video row: VIDEO parts (a 4 s MP4 per client) through the encoder
    against the model's video path on the same frames, and decoding's share. Needs the hf
    extra."""
    concurrency: int = bench_setting(16, gt=0)
    """HTTP clients calling /encode then /send in a loop, each with its own images."""
    served_seconds: float = bench_setting(60.0, gt=0)
    """Measured /encode time, over all rounds."""
    raw_seconds: float = bench_setting(15.0, gt=0)
    """Measured raw forward time, over all rounds."""
    settle_seconds: float = bench_setting(1.0, ge=0)
    """Per served encoder round, time the clients get to fill the pipeline first."""
    rounds: int = bench_setting(3, gt=0)
    """Raw and served phases alternate this many times and are pooled."""
    probe_interval: float = bench_setting(0.05, gt=0)
    """Seconds between two /health probes."""
    load_nice: int = bench_setting(0, ge=0, le=19)
    """Niceness added to the process running the clients and ranks (0 measured faster than 10 on 2
    cores)."""
    plots: Path | None = bench_setting(None)
    """Write PNG plots of the /send ratios into this directory."""
    http: bool = bench_setting(False)
    """Only the HTTP rows: calls/s and server CPU per call of pulls, /send (a stand-in engine),
    /health and a sibling's /encode, ours beside hypercorn with a one-line app (the floor of our
    fixed stack) and an SGLang-style FastAPI/uvicorn server (needs the bench extra)."""
    http_seconds: float = bench_setting(1.0, gt=0)
    """Seconds each server is called per route and round in the HTTP rows."""
    http_clients: int = bench_setting(2, gt=0)
    """Client processes of the HTTP rows."""
    http_connections: int = bench_setting(4, gt=0)
    """Keep-alive connections of each client process of the HTTP rows."""
    baseline: Path | None = bench_setting(None)
    """Also measure another build of trio-encode in the same run, alternating: a source tree (with
    src/trio_encode) or a Python interpreter that has it installed. The HTTP rows get its server
    as one more column; the /send rows its served /send (arena on) beside this build's, both in
    processes of their own."""
    progress: bool = bench_setting(True)
    """Report each phase on stderr."""

    @property
    def arena_modes(self) -> tuple[bool, ...]:
        """The served transfer rows to run: with the arena (True), without it (False)."""
        return _ARENA_MODES[self.arena]

    @property
    def encoder_tp(self) -> int:
        """Ranks the encoder rows' clients send to (they only end each scope)."""
        return min(4, max(self.tps))
