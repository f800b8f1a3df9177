"""``trio-encode serve`` as an operator starts it: quiet engine logs, the port bound first."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import httpx

from support.cli_process import read_until_serving, run_demo, serving, wait_ready

_GLOG_INFO = re.compile(r"^I\d{4} ", re.MULTILINE)


def test_mooncake_info_lines_are_quiet_by_default_and_every_answer_is_logged() -> None:
    with serving("--port", "0", "--shutdown-grace", "0") as process:
        lines: list[str] = []
        url = read_until_serving(process, lines)
        assert httpx.get(url + "/livez", timeout=10).status_code == 200
        wait_ready(url)
        process.terminate()
        assert process.stderr is not None
        output = "".join(lines) + process.stderr.read()
        assert process.wait(timeout=30) == 0
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
        with serving("--port", str(port)) as process:
            _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr
    assert "Address already in use" in stderr or "address already in use" in stderr, stderr
    assert f"cannot listen on 127.0.0.1:{port}" in stderr, stderr  # which address, and why
    assert "Traceback" not in stderr
    assert "model loaded" not in stderr
    # Bound before anything else: no engine started, no arena registered.
    assert "transfer engine ready" not in stderr, stderr
    assert "registered" not in stderr, stderr


def test_the_demo_keeps_mooncake_info_lines_out_of_its_output() -> None:
    result, _ = run_demo("--requests", "1", "--images", "1")
    assert not _GLOG_INFO.search(result.stderr), result.stderr


def test_a_model_that_cannot_load_fails_the_start_with_one_line(tmp_path: Path) -> None:
    weights = tmp_path / "broken.safetensors"
    weights.write_bytes(b"not a safetensors file")
    with serving("--port", "0", "--weights", str(weights)) as process:
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr
    assert "Error: the model could not be loaded:" in stderr
    assert "Traceback" not in stderr
