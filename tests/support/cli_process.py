"""``trio-encode`` run as an operator runs it: a child process in the operator's environment.

The test run quiets Mooncake through its own variables; these helpers drop them, so a test
sees what an operator sees (and that the command quiets Mooncake by itself).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

ROWS = re.compile(r"│ (.+?)\s+│\s+(.+?) │")
"""A row of the demo's result table: its label and its value."""


def operator_env(**extra: str) -> dict[str, str]:
    """This process's environment without Mooncake's log knobs, plus ``extra``."""
    inherited = {
        k: v for k, v in os.environ.items() if k not in ("MC_LOG_LEVEL", "GLOG_minloglevel")
    }
    return {**inherited, **extra}


@contextmanager
def serving(*args: str, **env: str) -> Iterator[subprocess.Popen[str]]:
    """``trio-encode serve ARGS`` with stderr piped; killed if the test leaves it running."""
    process = subprocess.Popen(
        [sys.executable, "-m", "trio_encode", "serve", *args],
        stderr=subprocess.PIPE,
        text=True,
        env=operator_env(**env),
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def read_until_serving(process: subprocess.Popen[str], lines: list[str]) -> str:
    """Read stderr into ``lines`` up to the "serving on URL" line; return the URL."""
    assert process.stderr is not None
    for line in process.stderr:
        lines.append(line)
        match = re.search(r"serving on (http://127\.0\.0\.1:\d+)", line)
        if match:
            return match[1]
    raise AssertionError("the server never said where it serves:\n" + "".join(lines))


def wait_ready(url: str) -> None:
    """Poll ``/readyz`` for up to ~30 s: the model loads behind the listening port."""
    for _ in range(600):
        if httpx.get(url + "/readyz", timeout=10).status_code == 200:
            return
        time.sleep(0.05)


def run_demo(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """``trio-encode demo ARGS`` run to the end; it must succeed. Returns it and its table."""
    result = subprocess.run(
        [sys.executable, "-m", "trio_encode", "demo", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=operator_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result, dict(ROWS.findall(result.stdout))
