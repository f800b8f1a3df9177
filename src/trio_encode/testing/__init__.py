"""Test doubles and drivers for code built on trio_encode (as ``trio.testing`` is for Trio)."""

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

__all__ = [
    "LATENCY_KINDS",
    "PHASES",
    "SEND_TIMEOUT",
    "Answer",
    "Caller",
    "Outcome",
    "Phase",
    "Schedule",
    "Workload",
    "cancel_everywhere",
    "count_steps",
    "explore_seeds",
    "random_schedule",
    "run_schedule",
    "seeded_scheduler",
]
