"""Break the lifecycle on purpose, one rule at a time, and check the tests notice.

Each mutant is one small edit to ``scope.py`` or ``registrations.py`` that re-creates a bug
from the failure stories (``docs/lifecycle.md``). Its *killers* are the tests that must fail
against a copy of the package with that edit; a mutant that leaves them green means a rule has
no test that would fail without it. Running only the killers keeps this fast enough for CI.

``python tests/mutants.py`` (``nox -s mutants``, run by CI) runs every mutant against its
killers and exits non-zero if any survives. ``python tests/mutants.py --broad`` runs each
against the whole lifecycle suite and lists every test that kills it, to choose killers from.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BROAD = (
    "tests/test_scope_invariants.py",
    "tests/test_scope_catches_naive.py",
    "tests/test_service_shutdown.py",
    "tests/test_registration_ledger.py",
    "tests/test_explore.py",
)
INVARIANTS = "tests/test_scope_invariants.py::"
EXPLORE = "tests/test_explore.py::"


@dataclass(frozen=True)
class Mutant:
    """An edit of ``file`` (under src/trio_encode) and the tests that must catch it."""

    file: str
    old: str
    new: str
    killers: tuple[str, ...]


MUTANTS: dict[str, Mutant] = {
    "siblings each register (story 1)": Mutant(
        "scope.py",
        "            if self._lease is None:\n                try:",
        "            if True:\n                try:",
        (
            INVARIANTS + "test_sibling_sends_register_once",
            EXPLORE + "test_random_schedules_without_cancellation",
        ),
    ),
    "requests sharing memory each register (story 10)": Mutant(
        "registrations.py",
        "            if region is None:\n                return await self._register",
        "            if True:\n                return await self._register",
        (
            INVARIANTS + "test_two_requests_sharing_memory_register_it_once",
            EXPLORE + "test_random_schedules_without_cancellation",
        ),
    ),
    "embedding dropped before deregistration (story 2)": Mutant(
        "scope.py",
        "        lease, self._lease = self._lease, None\n",
        "        lease, self._lease = self._lease, None\n        self._embedding = None\n",
        (
            INVARIANTS + "test_embedding_is_dropped_only_after_deregistration",
            EXPLORE + "test_random_schedules_without_cancellation",
        ),
    ),
    "transfer errors swallowed (story 3)": Mutant(
        "scope.py",
        "        except EngineError as exc:\n            if exc.call",
        "        except BaseException:\n            pass\n        except EngineError as exc:\n"
        "            if exc.call",
        (INVARIANTS + "test_transfer_error_is_raised_with_its_code",),
    ),
    "transfer runs in the handler, not the scope (story 6)": Mutant(
        "scope.py",
        "            self._nursery.start_soon(self._run_attempt, attempt)\n"
        "        attempt.waiters += 1",
        "            attempt.waiters += 1\n            await self._run_attempt(attempt)\n"
        "        else:\n            attempt.waiters += 1",
        (INVARIANTS + "test_scope_waits_for_a_transfer_stuck_in_its_thread",),
    ),
    "cleanup not shielded (story 6)": Mutant(
        "scope.py",
        "            with trio.CancelScope(shield=True):\n                await self._release()",
        "            if True:\n                await self._release()",
        (INVARIANTS + "test_cancelling_the_service_nursery_still_deregisters",),
    ),
    "retry counted as a new receiver (story 7)": Mutant(
        "scope.py",
        "            self._done.add(attempt.receiver)",
        "            self._done.add(Receiver(attempt.receiver.session_id, -len(self._done) - 1))",
        (INVARIANTS + "test_retry_from_the_same_receiver_is_not_a_new_receiver",),
    ),
    "failed encode leaves the scope open (story 8)": Mutant(
        "scope.py",
        '            self._finish("encode_failed")\n        else:',
        "            pass\n        else:",
        (INVARIANTS + "test_failed_encode_answers_every_waiting_sender",),
    ),
    "disconnected client's send still starts (invariant 7)": Mutant(
        "scope.py",
        "                attempt.withdraw.cancel()",
        "                pass",
        (INVARIANTS + "test_client_disconnect_before_its_transfer_starts_withdraws_it",),
    ),
    "lease granted on a region still registering": Mutant(
        "registrations.py",
        '            if region.state != "live":',
        '            if region.state == "deregistering":',
        (
            "tests/test_registration_ledger.py::test_lease_waits_for_a_region_still_registering",
            EXPLORE + "test_random_schedules_without_cancellation",
        ),
    ),
    "lease granted on a region being deregistered": Mutant(
        "registrations.py",
        '            if region.state != "live":',
        '            if region.state == "registering":',
        ("tests/test_registration_ledger.py::test_lease_waits_for_a_region_being_deregistered",),
    ),
}


def _mutated_tree(tmp: str, name: str, mutant: Mutant) -> Path:
    src = Path(tmp) / "src"
    shutil.copytree(ROOT / "src", src)
    target = src / "trio_encode" / mutant.file
    text = target.read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(f"mutant {name!r} no longer applies to {mutant.file}; update it")
    target.write_text(text.replace(mutant.old, mutant.new))
    return src


def _pytest(src: Path, tests: tuple[str, ...], *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT / 'tests'}"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *tests]
    try:
        return subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired as exc:
        # A hang is a failure too, if a poor one.
        return subprocess.CompletedProcess(command, 1, "", f"timed out: {exc}")


def run_mutant(name: str, mutant: Mutant) -> bool:
    """True if the mutant's killers fail (the mutant is killed)."""
    if not mutant.killers:
        raise SystemExit(f"mutant {name!r} names no killers")
    with tempfile.TemporaryDirectory() as tmp:
        result = _pytest(_mutated_tree(tmp, name, mutant), mutant.killers, "-x")
        # Only failing tests kill: an error finding a killer (exit code 4 or 5) is no kill.
        return result.returncode == 1


def killers_of(name: str, mutant: Mutant) -> list[str]:
    """Every test in the broad lifecycle suite that fails with the mutant in place."""
    with tempfile.TemporaryDirectory() as tmp:
        result = _pytest(_mutated_tree(tmp, name, mutant), BROAD, "-rf", "--tb=no")
        return re.findall(r"^FAILED (\S+)", result.stdout, flags=re.MULTILINE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broad", action="store_true", help="list every test that kills each")
    parser.add_argument("-k", dest="only", default="", help="only mutants whose name has this")
    args = parser.parse_args()
    chosen = {name: m for name, m in MUTANTS.items() if args.only in name}
    if args.broad:
        for name, mutant in chosen.items():
            killers = killers_of(name, mutant)
            print(f"{name}: {len(killers)} killer(s)")
            for killer in killers:
                print(f"    {killer}")
        return 0
    survivors = []
    for name, mutant in chosen.items():
        killed = run_mutant(name, mutant)
        print(f"{'killed  ' if killed else 'SURVIVED'}  {name}", flush=True)
        if not killed:
            survivors.append(name)
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
