"""Every setting of a running server in one frozen value, built once by the CLI (or a test).

Kept apart from the CLI so that in-process servers (tests, the demo) are configured with the
same value and the same defaults as ``trio-encode serve``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from trio_encode.encoder.settings import EncoderSettings
from trio_encode.engine.faults import FaultPlan
from trio_encode.engine.mooncake import MooncakeSettings
from trio_encode.service import ServiceSettings

MiB = 1 << 20

LogFormat = Literal["kv", "json"]


@dataclass(frozen=True)
class ServerSettings:
    """How the HTTP server, the request scopes and the transfer engine are set up."""

    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port; the bound address is logged and reported to in-process callers."""
    send_timeout: float = 180.0
    """Backstop deadline of a request scope, in seconds from its creation."""
    shutdown_grace: float = 30.0
    """On shutdown, how long live scopes may keep serving their siblings' sends."""
    max_body_bytes: int = 64 * MiB
    """Larger request bodies are refused with 413 before they are parsed."""
    token: str | None = None
    """When set, /encode and /send need ``Authorization: Bearer <token>``."""
    media_dir: Path | None = None
    """When set, ``mm_items`` may name image files inside this directory."""
    engine: MooncakeSettings = field(default_factory=MooncakeSettings)
    engine_faults: FaultPlan | None = None
    """When set, the transfer engine fails this fraction of its calls with Mooncake's own
    codes (a drill for the error paths; see ``trio_encode.engine.faults``). Off by default."""
    encoder: EncoderSettings = field(default_factory=EncoderSettings)
    log_level: str = "INFO"
    log_format: LogFormat = "kv"
    malloc_arenas: int | None = 2
    """glibc malloc arenas for the whole ``trio-encode serve`` process; None keeps glibc's
    default (8 per core), under which RSS climbs far above the live data
    (see ``trio_encode.server.heap``)."""
    heap_trim_seconds: float = 1.0
    """How often the free pages inside malloc's heaps go back to the system; 0 never."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.send_timeout > 0:
            raise ValueError(f"send_timeout must be positive, got {self.send_timeout}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0, got {self.shutdown_grace}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.malloc_arenas is not None and self.malloc_arenas < 1:
            raise ValueError(f"malloc_arenas must be >= 1, got {self.malloc_arenas}")
        if self.heap_trim_seconds < 0:
            raise ValueError(f"heap_trim_seconds must be >= 0, got {self.heap_trim_seconds}")
        if self.token == "":
            raise ValueError("token must not be empty (leave it unset to disable auth)")

    def encoder_settings(self) -> EncoderSettings:
        """The encoder's settings, with the server's ``media_dir`` (if set) applied."""
        if self.media_dir is None:
            return self.encoder
        return replace(self.encoder, media_dir=self.media_dir)

    def service_settings(self) -> ServiceSettings:
        """The part of these settings that the request scopes obey."""
        return ServiceSettings(send_timeout=self.send_timeout, shutdown_grace=self.shutdown_grace)
