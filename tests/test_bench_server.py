"""``trio-encode bench`` end to end with a tiny model, a few transfers and short phases.

Only the shape of the result is checked, and that every ratio is a positive finite number:
timings on a shared 2-core machine say nothing in a test.
"""

from __future__ import annotations

import io
import json
import math

import trio
from click.testing import CliRunner
from PIL import Image

from trio_encode.bench.config import BenchConfig
from trio_encode.bench.load import natural_jpegs
from trio_encode.bench.server import BenchResult, run_bench
from trio_encode.cli import cli
from trio_encode.encoder import EncoderSettings

TINY = EncoderSettings(
    image_size=32, patch_size=8, width=32, depth=2, heads=2, hidden_size=64, max_batch_size=2
)
TINY_FLAGS = ["--image-size", "32", "--patch-size", "8", "--width", "32", "--depth", "2"]
TINY_FLAGS += ["--heads", "2", "--hidden-size", "64", "--max-batch-size", "2"]
SHORT = {"served_seconds": 0.6, "raw_seconds": 0.2, "settle_seconds": 0.1, "rounds": 2}


def _positive_finite(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_bench_measures_every_row_and_leaves_nothing_behind() -> None:
    config = BenchConfig(
        encoder=TINY, tp=2, transfer_images=(1, 3), transfer_requests=3, concurrency=3, **SHORT
    )
    result: BenchResult = trio.run(run_bench, config)

    assert [row.images for row in result.transfers] == [1, 3]
    for row in result.transfers:
        assert row.nbytes == row.images * result.bytes_per_image
        # 2 rounds x 3 req_ids x 2 ranks, on both sides.
        assert row.raw_bytes == row.served_bytes == 2 * 3 * 2 * row.nbytes
    assert result.bytes_per_image == 16 * 64 * 4
    assert result.encoder.raw_images > 0
    assert result.encoder.served_images > 0
    assert 0 < result.encoder.mean_batch <= 2
    assert set(result.ratios()) == {"transfer_1", "transfer_3", "encoder"}
    assert all(_positive_finite(ratio) for ratio in result.ratios().values())
    assert result.health.probes > 0
    assert result.health.ok == result.health.probes
    assert 0 <= result.health.p99_seconds <= result.health.max_seconds
    assert (
        result.peak_rss_bytes >= result.rss_after_transfers_bytes >= result.rss_after_load_bytes > 0
    )
    assert result.registrations_left == 0
    assert result.scopes_left == 0

    table = result.table()
    assert table.count(" x 2 ranks") == 2  # one line per transfer row
    assert "encoder B=2, 3 clients" in table
    assert "/health every 50 ms" in table
    assert "clients in a separate process" in table
    assert "peak RSS" in table
    json.dumps(result.to_json())  # serialisable as is


def test_bench_command_prints_json() -> None:
    args = ["bench", *TINY_FLAGS, "--json", "--tp", "1", "--transfer-images", "2"]
    args += ["--transfer-requests", "2", "--concurrency", "2", "--served-seconds", "0.4"]
    args += ["--raw-seconds", "0.2", "--settle-seconds", "0.1", "--rounds", "1"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["ratios"]) == {"transfer_2", "encoder"}
    assert all(_positive_finite(ratio) for ratio in data["ratios"].values())
    assert data["encoder"]["batch_size"] == 2
    assert data["tp"] == 1
    assert data["peak_rss_bytes"] > 0


def test_bench_refuses_a_bad_image_count() -> None:
    result = CliRunner().invoke(cli, ["bench", "--transfer-images", "1,0"])
    assert result.exit_code == 2
    assert "--transfer-images" in result.output


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
