"""Cancel-anywhere and randomised-schedule exploration of ``/encode`` and ``/send``.

Each sweep cancels one caller at every checkpoint its task reaches, one run per checkpoint,
and judges every run against the lifecycle's invariants, "no write after a 200" and "siblings
unaffected" (``trio_encode.testing.explore``). The random samples draw latencies, arrivals,
shared memory and cancellations from seeds; a failure prints the schedule, and
``--explore-seed N`` replays seed N alone. ``nox -s explore`` runs 10,000 seeds of each.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from trio_encode.testing import (
    PHASES,
    Caller,
    Outcome,
    Schedule,
    Workload,
    cancel_everywhere,
    explore_seeds,
    random_schedule,
    run_schedule,
)
from trio_encode.testing.images import image_uri
from trio_encode.testing.stand_in_encoder import StandInEncoder, expected_embedding

IMAGES = (b"explore-image-0", b"explore-image-1")
LATENCY_SEEDS = range(8)
"""Each sweep runs once per latency seed: the same callers, different virtual timings."""


@pytest.fixture(scope="module")
def workload() -> Workload:
    return Workload(
        StandInEncoder,
        [image_uri(image) for image in IMAGES],
        [bytes(expected_embedding([image]).numpy().tobytes()) for image in IMAGES],
    )


def _tp2(*callers: Caller, requests: int = 1, shared: bool = False) -> Schedule:
    return Schedule(seed=0, callers=callers, ranks=2, requests=requests, shared_image=shared)


SWEEPS: dict[str, tuple[Schedule, int]] = {
    # name: (schedule, index of the caller cancelled at each of its checkpoints)
    "opener": (_tp2(Caller(0, 0), Caller(0, 1, arrive=0.5)), 0),
    "opener, sibling first at the scope": (_tp2(Caller(0, 0), Caller(0, 1, arrive=0.0)), 0),
    "joiner": (_tp2(Caller(0, 0), Caller(0, 1, arrive=1.0)), 1),
    "late sender": (_tp2(Caller(0, 0), Caller(0, 1, gap=3.0)), 1),
    "sender racing a sibling's register": (_tp2(Caller(0, 0), Caller(0, 1, arrive=0.25)), 1),
    "second request on shared memory": (
        _tp2(
            Caller(0, 0),
            Caller(0, 1),
            Caller(1, 0, arrive=3.0),
            Caller(1, 1, arrive=3.0),
            requests=2,
            shared=True,
        ),
        2,
    ),
}
_SWEPT: dict[str, list[Outcome]] = {}


def _swept(name: str, workload: Workload) -> list[Outcome]:
    """The sweep's outcomes, run once per test session (several tests read them)."""
    if name not in _SWEPT:
        _SWEPT[name] = _sweep(name, workload)
    return _SWEPT[name]


def _sweep(name: str, workload: Workload) -> list[Outcome]:
    schedule, victim = SWEEPS[name]
    outcomes = []
    for seed in LATENCY_SEEDS:
        outcomes += cancel_everywhere(dataclasses.replace(schedule, seed=seed), victim, workload)
    return outcomes


def _report(failing: list[Outcome], limit: int = 5) -> str:
    shown = "\n\n".join(outcome.describe() for outcome in failing[:limit])
    return f"{len(failing)} schedule(s) broke an invariant; the first {limit}:\n\n{shown}"


@pytest.mark.parametrize("name", list(SWEEPS))
def test_cancel_at_every_checkpoint(name: str, workload: Workload) -> None:
    """A caller cancelled at any checkpoint leaves every invariant standing, its siblings
    served, and its retry served, with no write into its buffer after its 200."""
    outcomes = _swept(name, workload)
    assert len(outcomes) > len(LATENCY_SEEDS)  # every sweep reaches several checkpoints
    failing = [outcome for outcome in outcomes if not outcome.ok]
    assert not failing, _report(failing)


def test_sweeps_reach_every_phase_but_release(workload: Workload) -> None:
    """Together the sweeps cancel a caller in the load, open, wait, register and transfer
    phases of the paths."""
    outcomes = [outcome for name in SWEEPS for outcome in _swept(name, workload)]
    assert set(PHASES) - {"release"} <= {outcome.phase for outcome in outcomes}
    for outcome in outcomes:
        if outcome.schedule.cancel_at:  # each run's cancellation landed at its own step
            assert outcome.victim_steps >= outcome.schedule.cancel_at
            assert outcome.phase is not None


def test_shared_memory_sweep_cancels_a_caller_waiting_on_a_release(workload: Workload) -> None:
    """The second request on shared memory is cancelled while the first deregisters it."""
    reached = {outcome.phase for outcome in _swept("second request on shared memory", workload)}
    assert "release" in reached


@pytest.mark.parametrize("seed", [7, 14, 56])
def test_a_seed_replays_exactly(seed: int, workload: Workload) -> None:
    """Equal schedules give identical runs (answers, findings, steps), so a printed failing
    seed replays (seeds 7, 14 and 56 each found a break before it was fixed)."""

    assert _facts(run_schedule(random_schedule(seed), workload)) == _facts(
        run_schedule(random_schedule(seed), workload)
    )


def test_a_sweep_replays_exactly(workload: Workload) -> None:
    """The same holds for a whole cancel-anywhere sweep, run for run."""
    swept = [_facts(outcome) for outcome in _swept("opener", workload)]
    assert swept == [_facts(outcome) for outcome in _sweep("opener", workload)]


def _facts(outcome: Outcome) -> tuple[object, ...]:
    """An outcome without the memory addresses, which differ from run to run."""
    answers = [(a.caller, a.attempt, a.call, a.status, a.engine_call) for a in outcome.answers]
    failures = [re.sub(r"0x[0-9a-f]+|\d{6,}", "#", failure) for failure in outcome.failures]
    return (answers, failures, outcome.victim_steps, outcome.phase)


@pytest.mark.parametrize("name", list(SWEEPS))
def test_uncancelled_runs_of_every_sweep_hold(name: str, workload: Workload) -> None:
    """The sweeps' schedules themselves (nobody cancelled) break nothing, so a failing sweep
    is a failure of cancellation."""
    schedule, _ = SWEEPS[name]
    for seed in LATENCY_SEEDS:
        outcome = run_schedule(dataclasses.replace(schedule, seed=seed), workload)
        assert outcome.ok, outcome.describe()


def _seeds(config: pytest.Config) -> list[int]:
    seed: int | None = config.getoption("explore_seed")
    if seed is not None:
        return [seed]
    count: int = config.getoption("explore_count")
    return list(range(count))


def test_random_schedules_without_cancellation(
    workload: Workload, pytestconfig: pytest.Config
) -> None:
    """Random latencies, arrival orders, sibling counts and shared memory, with worker-thread
    calls taking no time and nobody cancelled: every invariant holds for every seed."""
    failing = explore_seeds(
        _seeds(pytestconfig), workload, cancellations=False, threads_take_time=False, faults=False
    )
    assert not failing, _report(failing)


def test_random_schedules_with_engine_faults(
    workload: Workload, pytestconfig: pytest.Config
) -> None:
    """As above, with one engine call in ten failing: each failure reaches the caller whose
    call it was as a 502 (its retry is served), and no other caller."""
    failing = explore_seeds(
        _seeds(pytestconfig), workload, cancellations=False, threads_take_time=False, faults=True
    )
    assert not failing, _report(failing)


def test_random_schedules(workload: Workload, pytestconfig: pytest.Config) -> None:
    """Everything random at once: latencies (worker-thread calls included), arrivals, shared
    memory, engine faults, and cancellations with retries. Every invariant holds."""
    failing = explore_seeds(_seeds(pytestconfig), workload)
    assert not failing, _report(failing)
