"""Break the lifecycle on purpose, one rule at a time, and check the tests notice.

Each mutant is one small edit to ``scope.py`` or ``registrations.py`` that re-creates a bug
from ``brief.md``. The scope tests run against a copy of the package with that edit; a mutant
that leaves them green means an invariant has no test that would fail without it.

Run it with ``nox -s mutants`` (or ``python tests/mutants.py``); it exits non-zero if any
mutant survives.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_scope_invariants.py",
    "tests/test_scope_catches_naive.py",
    "tests/test_service_shutdown.py",
]

# name -> (file under src/trio_encode, text to replace, replacement)
MUTANTS: dict[str, tuple[str, str, str]] = {
    "siblings each register (story 1)": (
        "scope.py",
        "            if self._leases is None:\n                try:",
        "            if True:\n                try:",
    ),
    "requests sharing memory each register (story 10)": (
        "registrations.py",
        "            if region is None:\n                return await self._register",
        "            if True:\n                return await self._register",
    ),
    "embedding dropped before deregistration (story 2)": (
        "scope.py",
        "        leases, self._leases = self._leases or [], None\n",
        "        leases, self._leases = self._leases or [], None\n        self._embedding = None\n",
    ),
    "transfer errors swallowed (story 3)": (
        "scope.py",
        "        except EngineError as exc:\n            if exc.call",
        "        except BaseException:\n            pass\n        except EngineError as exc:\n"
        "            if exc.call",
    ),
    "transfer runs in the handler, not the scope (story 6)": (
        "scope.py",
        "            self._nursery.start_soon(self._run_attempt, attempt)\n"
        "        attempt.waiters += 1",
        "            attempt.waiters += 1\n            await self._run_attempt(attempt)\n"
        "        else:\n            attempt.waiters += 1",
    ),
    "cleanup not shielded (story 6)": (
        "scope.py",
        "            with trio.CancelScope(shield=True):\n                await self._release()",
        "            if True:\n                await self._release()",
    ),
    "retry counted as a new receiver (story 7)": (
        "scope.py",
        "            self._done.add(attempt.receiver)",
        "            self._done.add(Receiver(attempt.receiver.session_id, -len(self._done) - 1))",
    ),
    "failed encode leaves the scope open (story 8)": (
        "scope.py",
        '            self._finish("encode_failed")\n        else:',
        "            pass\n        else:",
    ),
    "disconnected client's send still starts (invariant 7)": (
        "scope.py",
        "                attempt.withdraw.cancel()",
        "                pass",
    ),
}


def run_mutant(name: str, filename: str, old: str, new: str) -> bool:
    """True if the tests fail (the mutant is killed)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT / "src", src)
        target = src / "trio_encode" / filename
        text = target.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"mutant {name!r} no longer applies to {filename}; update it")
        target.write_text(text.replace(old, new))
        env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT / 'tests'}"}
        try:
            result = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.TimeoutExpired:
            return True  # a hang is a failure too, if a poor one
        return result.returncode != 0


def main() -> int:
    survivors = []
    for name, (filename, old, new) in MUTANTS.items():
        killed = run_mutant(name, filename, old, new)
        print(f"{'killed  ' if killed else 'SURVIVED'}  {name}")
        if not killed:
            survivors.append(name)
    print(f"{len(MUTANTS) - len(survivors)} of {len(MUTANTS)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
