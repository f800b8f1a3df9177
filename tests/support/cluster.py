"""Real processes for fleet tests: a ``mooncake_master`` from the installed wheel and encode
servers started with ``trio-encode serve``, each on a free loopback port.

Processes are slow to start on small machines, so tests share them per module and keep the
model tiny. A missing ``mooncake_master`` fails the test (it is part of the Mooncake wheel).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from trio_encode.client import metric_value
from trio_encode.encoder import EncoderSettings
from trio_encode.settings import ServerSettings, serve_flags

TINY_ENCODER = EncoderSettings(
    image_size=64, patch_size=8, width=64, heads=2, depth=1, hidden_size=1024, torch_threads=1
)
"""A small built-in ViT: 64 tokens of 1024 floats (256 KiB) per image, quick to load and run."""
TINY_MODEL = tuple(serve_flags(ServerSettings.exactly(encoder=TINY_ENCODER)))
"""Its ``trio-encode serve`` flags."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _environment() -> dict[str, str]:
    env = dict(os.environ, MC_LOG_LEVEL="ERROR", GLOG_minloglevel="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _wait(check: object, what: str, within: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {process.returncode}")
        try:
            if check():  # type: ignore[operator]
                return
        except (OSError, httpx.HTTPError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what}: not ready within {within} s")


@dataclass
class Master:
    address: str
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        _stop(self.process)


def start_master(log_dir: Path) -> Master:
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    port = free_port()
    log = (log_dir / f"master-{port}.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--rpc_port={port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={free_port()}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=_environment(),
    )

    def listening() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True

    _wait(listening, "mooncake_master", 20.0, process)
    return Master(f"127.0.0.1:{port}", process)


@dataclass
class EncoderProcess:
    url: str
    process: subprocess.Popen[bytes]

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return metric_value(text, name, **labels)

    def forwards(self) -> float:
        """Images this encoder ran through the model (the warm-up excluded)."""
        return self.metric("encoder_batch_size_sum")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        _stop(self.process)


def start_encoders(
    log_dir: Path, *option_lists: Sequence[str], store: Master | None
) -> list[EncoderProcess]:
    """One ``trio-encode serve`` per option list, started together, returned once each is
    ready (and connected to the store, when one is given)."""
    started = []
    for options in option_lists:
        port = free_port()
        log = (log_dir / f"encoder-{port}.log").open("wb")
        store_options = ["--store-master", store.address] if store is not None else []
        process = subprocess.Popen(
            [
                sys.executable, "-m", "trio_encode.cli", "serve", "--port", str(port),
                "--send-timeout", "5", "--shutdown-grace", "1", "--log-level", "WARNING",
                "--store-segment-bytes", str(64 << 20), "--store-buffer-bytes", str(16 << 20),
                *TINY_MODEL, *store_options, *options,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_environment(),
        )  # fmt: skip
        started.append(EncoderProcess(f"http://127.0.0.1:{port}", process))
    for encoder in started:
        _wait(
            lambda e=encoder: httpx.get(e.url + "/health", timeout=1).status_code == 200,
            encoder.url,
            90.0,
            encoder.process,
        )
        if store is not None:
            _wait(
                lambda e=encoder: e.metric("store_connected") == 1,
                f"{encoder.url} store",
                30.0,
                encoder.process,
            )
    return started


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
