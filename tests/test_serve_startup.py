"""``trio-encode serve`` as an operator starts it: quiet engine logs, the port bound first."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

_GLOG_INFO = re.compile(r"^I\d{4} ", re.MULTILINE)


def _serve(*args: str) -> subprocess.Popen[str]:
    # The operator's environment: no MC_LOG_LEVEL of the test run's own.
    env = {key: value for key, value in os.environ.items() if key != "MC_LOG_LEVEL"}
    return subprocess.Popen(
        [sys.executable, "-m", "trio_encode.cli", "serve", *args],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_mooncake_info_lines_are_quiet_by_default_and_every_answer_is_logged() -> None:
    process = _serve("--port", "0", "--shutdown-grace", "0")
    try:
        assert process.stderr is not None
        lines: list[str] = []
        url = None
        for line in process.stderr:
            lines.append(line)
            match = re.search(r"serving on (http://127\.0\.0\.1:\d+)", line)
            if match:
                url = match[1]
                break
        assert url is not None, "".join(lines)
        assert httpx.get(url + "/livez", timeout=10).status_code == 200
        for _ in range(600):
            if httpx.get(url + "/readyz", timeout=10).status_code == 200:
                break
            time.sleep(0.05)
        process.terminate()
        output = "".join(lines) + process.stderr.read()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not _GLOG_INFO.search(output), output
    access = [line for line in output.splitlines() if "logger=trio_encode.access" in line]
    assert any("path=/livez" in line and "status=200" in line for line in access), output
    assert any("path=/readyz" in line and "status=200" in line for line in access), output
    # The port was bound before the model was loaded; the start names the transport.
    assert output.index("serving on") < output.index("model loaded")
    assert re.search(r"transfer engine ready at \S+ over tcp", output), output
    assert re.search(r"ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ", output)


def test_a_port_in_use_fails_at_once_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = _serve("--port", str(port))
        try:
            _, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 1, stderr
    assert "Address already in use" in stderr or "address already in use" in stderr, stderr
    assert "Traceback" not in stderr
    assert "model loaded" not in stderr
    # Bound before anything else: no engine started, no arena registered.
    assert "transfer engine ready" not in stderr, stderr
    assert "registered" not in stderr, stderr


def test_the_demo_keeps_mooncake_info_lines_out_of_its_output() -> None:
    env = {key: value for key, value in os.environ.items() if key != "MC_LOG_LEVEL"}
    result = subprocess.run(
        [sys.executable, "-m", "trio_encode.cli", "demo", "--requests", "1", "--images", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not _GLOG_INFO.search(result.stderr), result.stderr


def test_a_model_that_cannot_load_fails_the_start_with_one_line(tmp_path: Path) -> None:
    weights = tmp_path / "broken.safetensors"
    weights.write_bytes(b"not a safetensors file")
    process = _serve("--port", "0", "--weights", str(weights))
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1, stderr
    assert "Error: the model could not be loaded:" in stderr
    assert "Traceback" not in stderr
