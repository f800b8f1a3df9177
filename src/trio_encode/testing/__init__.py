"""Test doubles and drivers for code built on trio_encode (as ``trio.testing`` is for Trio).

- :mod:`~trio_encode.testing.memory_engine`: an in-memory transfer engine with Mooncake's
  rules (and the RDMA one TCP cannot show), thread pools, scripted latencies, failures, gates
  and frozen peers, for deterministic tests on Trio's mock clock;
- :mod:`~trio_encode.testing.forwarding`: the base of engine wrappers that watch or fail some
  calls and forward the rest;
- :mod:`~trio_encode.testing.stand_in_encoder`: an encoder whose embedding is a pure function
  of the image bytes, so a test knows what every receiver must hold;
- :mod:`~trio_encode.testing.images`: seeded test images (noise, solid colours, photo-like
  JPEGs) and data URIs;
- :mod:`~trio_encode.testing.explore`: cancel-anywhere and seeded-schedule exploration of the
  ``/encode`` and ``/send`` paths.
- :mod:`~trio_encode.testing.identity`: embeddings that name their image (a drill's), read
  back word by word by a receiver.

The names below load their module on first use: a process that needs one small module (a
soak receiver reading :mod:`~trio_encode.testing.identity`) does not import torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOMES = {
    "Answer": "trio_encode.testing.explore",
    "CallRecord": "trio_encode.testing.memory_engine",
    "Caller": "trio_encode.testing.explore",
    "Gate": "trio_encode.testing.memory_engine",
    "InMemoryEngine": "trio_encode.testing.memory_engine",
    "InMemoryFabric": "trio_encode.testing.memory_engine",
    "LATENCY_KINDS": "trio_encode.testing.explore",
    "Outcome": "trio_encode.testing.explore",
    "PHASES": "trio_encode.testing.explore",
    "Phase": "trio_encode.testing.explore",
    "SEND_TIMEOUT": "trio_encode.testing.explore",
    "Schedule": "trio_encode.testing.explore",
    "StandInEncoder": "trio_encode.testing.stand_in_encoder",
    "Workload": "trio_encode.testing.explore",
    "cancel_everywhere": "trio_encode.testing.explore",
    "count_steps": "trio_encode.testing.explore",
    "expected_embedding": "trio_encode.testing.stand_in_encoder",
    "explore_seeds": "trio_encode.testing.explore",
    "image_uri": "trio_encode.testing.images",
    "random_schedule": "trio_encode.testing.explore",
    "run_schedule": "trio_encode.testing.explore",
    "seeded_scheduler": "trio_encode.testing.explore",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


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
