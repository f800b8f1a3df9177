"""The encoder benchmark runs end to end (tiny model, a fraction of a second per phase)."""

from __future__ import annotations

from trio_encode.bench.encoder import run_encoder_bench
from trio_encode.encoder import EncoderSettings

TINY = EncoderSettings(image_size=32, patch_size=8, width=32, depth=2, heads=2, hidden_size=64)


def test_bench_reports_raw_and_served_throughput() -> None:
    result = run_encoder_bench(
        TINY, batch_size=2, concurrency=4, raw_batches=2, served_seconds=0.6, rounds=2
    )
    assert result.raw_images == 8
    assert result.served_images > 0
    assert 0 < result.mean_served_batch <= 2
    assert result.ratio > 0
    assert result.max_loop_lateness >= 0
    assert "served/raw" in result.report()
