"""``trio-encode bench`` end to end with tiny sizes, a tiny model and short phases.

Only the shape of the result is checked, that every ratio is a positive finite number, and
the registration counts (exact by construction): timings on a shared 2-core machine say
nothing in a test.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import trio
from click.testing import CliRunner
from PIL import Image

from trio_encode.cli import cli
from trio_encode.encoder import EncoderSettings
from trio_encode.testing.images import natural_jpegs
from trio_encode.tools.bench.results import BenchResult
from trio_encode.tools.bench.run import run_bench
from trio_encode.tools.bench.settings import BenchConfig

TINY = EncoderSettings(
    image_size=32, patch_size=8, width=32, depth=2, heads=2, hidden_size=64, max_batch_size=2
)
TINY_FLAGS = ["--image-size", "32", "--patch-size", "8", "--width", "32", "--depth", "2"]
TINY_FLAGS += ["--heads", "2", "--hidden-size", "64", "--max-batch-size", "2"]
SHORT = {"served_seconds": 0.6, "raw_seconds": 0.2, "settle_seconds": 0.1, "rounds": 2}


def _positive_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def test_bench_measures_every_row_and_leaves_nothing_behind(tmp_path: Path) -> None:
    config = BenchConfig(
        encoder=TINY,
        sizes=(100_000, 300_000),
        tps=(1, 2),
        transfer_requests=3,
        concurrency=3,
        plots=tmp_path,
        progress=False,
        **SHORT,
    )
    result: BenchResult = trio.run(run_bench, config)

    cells = [(row.nbytes, row.tp, row.arena) for row in result.transfers]
    assert cells == [
        (n, tp, arena) for n in (98_304, 303_104) for tp in (1, 2) for arena in (True, False)
    ]
    for row in result.transfers:
        # 2 rounds x 3 req_ids x TP ranks, on every side.
        assert row.raw.nbytes == row.served.nbytes == 2 * 3 * row.tp * row.nbytes
        assert row.peer is not None
        assert row.peer.nbytes == row.served.nbytes
        assert _positive_finite(row.served_over_raw)
        assert _positive_finite(row.served_over_peer)
        assert row.registrations_per_request == (0 if row.arena else 1)
        # The same sends again, answered as repeats: timed, every rank's last landing checked.
        assert row.sends_per_rank == 2 * 3
        assert _positive_finite(row.http_ms)
    assert result.encoder is not None
    assert result.health is not None
    assert result.encoder.raw_images > 0
    assert result.encoder.served_images > 0
    assert 0 < result.encoder.mean_batch <= 2
    assert _positive_finite(result.encoder.ratio)
    assert result.health.probes > 0
    assert result.health.ok == result.health.probes
    assert result.registrations_left == 0
    assert result.scopes_left == 0

    table = result.table()
    assert table.count("\n") >= 8 + 2
    assert "served/peer" in table
    assert "reg/req" in table
    assert "http ms" in table
    assert "encoder builtin-vit" in table
    assert "/health every 50 ms" in table
    json.dumps(result.to_json(), default=str)  # serialisable
    for name in ("send_vs_peer.png", "send_vs_raw.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def test_bench_command_prints_json() -> None:
    args = ["bench", *TINY_FLAGS, "--json", "--no-progress", "--sizes", "0.1MB", "--tps", "2"]
    args += ["--arena", "on", "--no-peer", "--no-encoder-rows", "--transfer-requests", "2"]
    args += ["--rounds", "1"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    (row,) = data["transfers"]
    assert row["tp"] == 2
    assert row["arena"] is True
    assert row["peer"] is None
    assert row["registrations_per_request"] == 0
    assert _positive_finite(row["served_over_raw"])
    assert _positive_finite(row["http_ms"])
    assert data["encoder"] is None


def test_the_modelled_run_is_labelled_a_model() -> None:
    result = CliRunner().invoke(
        cli, ["bench", "--cost-model", "rdma", "--sizes", "1MB", "--tps", "1"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("MODEL, not a measurement")


def test_bench_refuses_a_bad_size() -> None:
    result = CliRunner().invoke(cli, ["bench", "--sizes", "1,0"])
    assert result.exit_code == 2
    assert "--sizes" in result.output


def test_the_load_images_are_distinct_jpegs_that_compress_like_photos() -> None:
    images = natural_jpegs(6, 224, seed=5)
    assert len(set(images)) == 6
    assert natural_jpegs(6, 224, seed=5) == images  # seeded: the same every run
    for data in images:
        picture = Image.open(io.BytesIO(data))
        assert picture.format == "JPEG"
        assert picture.size == (224, 224)
        # A 224x224 noise PNG is ~150 kB; a photo of that size is ~10-30 kB.
        assert 5_000 < len(data) < 40_000
