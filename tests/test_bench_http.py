"""``trio-encode bench --http`` and ``--baseline`` with tiny rounds: every route on every server
(ours, the hypercorn floor, the SGLang-style server, and ours from a baseline build: this same
tree), and the /send rows of this build against the baseline, each in a process of its own.

Only shapes are checked and that every number is positive and finite: timings on a shared
2-core machine say nothing in a test.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import trio
from click.testing import CliRunner

from trio_encode.cli import cli
from trio_encode.tools.bench.calls import ROUTES, Build
from trio_encode.tools.bench.run import run_bench
from trio_encode.tools.bench.settings import BenchConfig

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("ours", "floor", "sglang", "baseline")
_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"


def test_http_rows_name_every_route_and_server_with_positive_numbers() -> None:
    flags = ["--http", "--rounds", "2", "--http-seconds", "0.4", "--http-clients", "1"]
    flags += ["--http-connections", "2", "--baseline", str(ROOT), "--no-progress"]
    outcome = CliRunner().invoke(cli, ["bench", *flags], catch_exceptions=False)
    assert outcome.exit_code == 0, outcome.output
    lines = outcome.output.splitlines()
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in ROUTES]
    # route, server, calls/s, rounds (low..high), us CPU/call: one row per route and server.
    assert [(row[0], row[1]) for row in rows] == [(r, s) for r in ROUTES for s in SERVERS]
    for row in rows:
        assert len(row) == 5, row
        low, high = (float(x) for x in row[3].split(".."))
        assert 0 < low <= float(row[2]) <= high, row
        assert float(row[4]) > 0, row
    ratios = [line for line in lines if line.split()[:1] == ["ratios"]]
    assert len(ratios) == len(ROUTES)
    for line in ratios:
        for name in ("CPU/call over floor", "calls/s over sglang", "calls/s over baseline"):
            value = re.search(re.escape(name) + " " + _NUMBER, line)
            assert value is not None, line
            assert math.isfinite(float(value[1])), line
            assert float(value[1]) > 0, line
    targeted = [line for line in ratios if "(meets)" in line or "target)" in line]
    assert len(targeted) == 3  # pulls, /send and /health carry the targets; /encode does not


def test_send_rows_compare_this_build_with_a_baseline_tree() -> None:
    config = BenchConfig(
        sizes=(100_000,),
        tps=(1, 2),
        transfer_requests=2,
        rounds=2,
        peer=False,
        encoder_rows=False,
        arena="on",
        baseline=ROOT,
        progress=False,
    )
    result = trio.run(run_bench, config)
    assert [(row.tp, row.transfers) for row in result.builds] == [(1, 4), (2, 8)]
    for row in result.builds:
        assert row.this.nbytes == row.baseline.nbytes == row.transfers * row.nbytes
        assert math.isfinite(row.ratio)
        assert row.ratio > 0
        assert len(row.this_rates) == len(row.baseline_rates) == 2
        assert row.this_cpu_seconds > 0
        assert row.baseline_cpu_seconds > 0
    table = result.table()
    assert "/send of this build against the baseline" in table
    assert result.to_json()["builds"][0]["ratio"] == result.builds[0].ratio
    assert result.registrations_left == result.scopes_left == 0


def test_a_baseline_is_a_source_tree_or_an_interpreter(tmp_path: Path) -> None:
    tree = Build.at(ROOT)
    assert tree.path == str(ROOT / "src")
    assert tree.env()["PYTHONPATH"] == str(ROOT / "src")
    interpreter = Build.at(Path(sys.executable))
    assert interpreter.python == sys.executable
    assert "PYTHONPATH" not in interpreter.env()
    with pytest.raises(ValueError, match="neither a source tree"):
        Build.at(tmp_path)
