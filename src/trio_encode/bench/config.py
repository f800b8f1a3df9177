"""What ``trio-encode bench`` runs: its own knobs, beside the server's model and engine.

The knobs are declared here once, as settings of the ``bench`` group, and become the bench
command's flags; the encoder and engine settings are the server's own (flags, variables and
the config file, as for ``serve``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass

from trio_encode.declare import setting
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.engine.mooncake import MooncakeSettings


def _counts(value: Any) -> Any:
    """``"1,4"`` -> ``(1, 4)``; anything else is left for pydantic to check."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


ImageCounts = Annotated[
    tuple[Annotated[int, Field(gt=0)], ...], BeforeValidator(_counts), Field(min_length=1)
]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class BenchConfig:
    """What to run; the defaults take about 2-3 minutes on 2 CPU cores."""

    encoder: EncoderSettings = Field(default_factory=EncoderSettings)
    """The model and batching (``max_batch_size`` is the B of both encoder sides). The
    encoder rows run with the cache off; the transfer rows' server caches their one image."""
    engine: MooncakeSettings = Field(default_factory=MooncakeSettings)
    tp: int = setting(
        4,
        group="bench",
        gt=0,
        help="Receiving prefill ranks, each with its own engine: the concurrency of both "
        "transfer sides.",
    )
    transfer_images: ImageCounts = setting(
        (1, 4),
        group="bench",
        help="One transfer row per count: a transfer is that many images' embeddings (1.6 MB "
        "each with the default model).",
    )
    transfer_requests: int = setting(
        64,
        group="bench",
        gt=0,
        help="req_ids per round and row; every rank sends each one.",
    )
    concurrency: int = setting(
        16,
        group="bench",
        gt=0,
        help="HTTP clients calling /encode then /send in a loop, each with its own image.",
    )
    served_seconds: float = setting(
        60.0, group="bench", gt=0, help="Measured /encode time, over all rounds."
    )
    raw_seconds: float = setting(
        15.0, group="bench", gt=0, help="Measured raw forward time, over all rounds."
    )
    settle_seconds: float = setting(
        1.0,
        group="bench",
        ge=0,
        help="Per served round, time the clients get to fill the pipeline before the clock.",
    )
    rounds: int = setting(
        3,
        group="bench",
        gt=0,
        help="Raw and served phases alternate this many times and are pooled.",
    )
    probe_interval: float = setting(
        0.05, group="bench", gt=0, help="Seconds between two /health probes."
    )
    load_nice: int = setting(
        0,
        group="bench",
        ge=0,
        le=19,
        help="Niceness added to the process running the encoder rows' clients (0 measured "
        "faster than 10).",
    )
