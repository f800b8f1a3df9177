"""``nox -s gpu`` rehearsed on the cpu: its very steps (``tests/gpu/steps.py``) with the
device set to ``cpu`` and a short bench, so that the first GPU a task is lent runs commands CI
has already run (the GPU checks, then ``trio-encode bench --vlm`` end to end), differing only
in the device. About 40 s on 2 cores."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from trio_encode.settings import child_environment

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_sessions_steps_pass_on_the_cpu() -> None:
    done = subprocess.run(
        [sys.executable, "tests/gpu/steps.py", "--device", "cpu", "--short", "-q"],
        cwd=ROOT,
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "3 passed" in done.stdout  # tests/gpu on the cpu: the device, float32, bfloat16
    # bench --vlm: the small Qwen2.5-VL served end to end, every image size in the mix.
    assert "encoder vlm(" in done.stdout, output[-6000:]
    assert "  tokens: " in done.stdout
    assert "left at the end: 0 registrations besides the arenas, 0 scopes" in done.stdout


def test_the_gpu_session_runs_those_steps() -> None:
    """The nox session is only an install and this script: nothing it runs is untried."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    (gpu,) = [
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "gpu"
    ]
    runs = [
        ast.unparse(call)
        for call in ast.walk(gpu)
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "session.run"
    ]
    assert runs == ["session.run('python', 'tests/gpu/steps.py', *session.posargs)"]
