"""The steps of ``nox -s gpu``, on one device: the GPU checks (``tests/gpu``), then the bench's
VLM encoder row (``trio-encode bench --vlm``).

    python tests/gpu/steps.py [--device cuda:0] [--short] [pytest arguments...]

``nox -s gpu`` runs this script in its environment (``nox -s gpu -- --device cpu --short``
rehearses it); ``tests/test_gpu_steps.py`` runs it in the normal suite with ``--device cpu
--short``. So the first run on a lent GPU differs from what CI runs every time only in its
device (and, unless ``--short`` is given, in the bench's length), not in untried commands.
Standard library only: it runs before anything is known about the environment.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SHORT_BENCH = (
    "--rounds", "1", "--raw-seconds", "1", "--served-seconds", "2", "--settle-seconds", "0.2",
    "--concurrency", "4", "--max-batch-size", "4",
)  # fmt: skip
"""A bench run of seconds, not minutes: one round, B=4 (the whole mix of image sizes)."""


def steps(device: str, *, short: bool = False, pytest_args: Sequence[str] = ()) -> list[list[str]]:
    """The commands, in order, with this interpreter (the session's environment)."""
    python = sys.executable
    bench_args = SHORT_BENCH if short else ()
    return [
        [python, "-m", "pytest", "--gpu", f"--gpu-device={device}", "tests/gpu", *pytest_args],
        [python, "-m", "trio_encode", "bench", "--vlm", "--device", device, *bench_args],
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (default cuda:0)")
    parser.add_argument("--short", action="store_true", help="a bench of seconds")
    known, pytest_args = parser.parse_known_args(argv)
    for command in steps(known.device, short=known.short, pytest_args=pytest_args):
        print("+", shlex.join(command), flush=True)
        code = subprocess.call(command, cwd=ROOT)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
