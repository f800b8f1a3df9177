"""Test doubles and drivers for code built on trio_encode (as ``trio.testing`` is for Trio).

- :mod:`~trio_encode.testing.memory_engine`: an in-memory transfer engine with Mooncake's
  rules (and the RDMA one TCP cannot show), thread pools, scripted latencies, failures, gates
  and frozen peers, for deterministic tests on Trio's mock clock;
- :mod:`~trio_encode.testing.stand_in_encoder`: an encoder whose embedding is a pure function
  of the image bytes, so a test knows what every receiver must hold;
- :mod:`~trio_encode.testing.images`: seeded test images (noise, solid colours, photo-like
  JPEGs) and data URIs;
- :mod:`~trio_encode.testing.explore`: cancel-anywhere and seeded-schedule exploration of the
  ``/encode`` and ``/send`` paths.
"""

from trio_encode.testing.explore import (
    LATENCY_KINDS,
    PHASES,
    SEND_TIMEOUT,
    Answer,
    Caller,
    Outcome,
    Phase,
    Schedule,
    Workload,
    cancel_everywhere,
    count_steps,
    explore_seeds,
    random_schedule,
    run_schedule,
    seeded_scheduler,
)
from trio_encode.testing.images import image_uri
from trio_encode.testing.memory_engine import CallRecord, Gate, InMemoryEngine, InMemoryFabric
from trio_encode.testing.stand_in_encoder import StandInEncoder, expected_embedding

__all__ = [
    "LATENCY_KINDS",
    "PHASES",
    "SEND_TIMEOUT",
    "Answer",
    "CallRecord",
    "Caller",
    "Gate",
    "InMemoryEngine",
    "InMemoryFabric",
    "Outcome",
    "Phase",
    "Schedule",
    "StandInEncoder",
    "Workload",
    "cancel_everywhere",
    "count_steps",
    "expected_embedding",
    "explore_seeds",
    "image_uri",
    "random_schedule",
    "run_schedule",
    "seeded_scheduler",
]
