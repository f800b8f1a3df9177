"""The cost model in the in-memory engine, and the modelled RDMA run built on it; and the
``--vlm`` bench's video row.

The model runs in virtual time, so its numbers are exact and the tests can state them. The
video row runs for real, in short phases: only its shape and counts are checked, and that its
rates are positive (timings on a shared 2-core machine say nothing in a test).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
import trio.testing

from trio_encode.encoder import EncoderSettings, load_backend
from trio_encode.encoder.video import decode_video
from trio_encode.engine import Write
from trio_encode.testing.costs import RDMA, CallCost, CostModel
from trio_encode.testing.memory_engine import InMemoryFabric
from trio_encode.testing.tiny_vlm import save_tiny_qwen2_5_vl
from trio_encode.tools.bench.phases import Progress
from trio_encode.tools.bench.rdma_model import PATHS, run_model
from trio_encode.tools.bench.results import BenchResult, VideoRow
from trio_encode.tools.bench.run import _video_row
from trio_encode.tools.bench.settings import BenchConfig
from trio_encode.tools.bench.videos import bench_videos

FLAT = CostModel(
    name="flat",
    register=CallCost(fixed=1e-3, per_byte=1e-9),
    deregister=CallCost(fixed=0.5e-3, per_byte=0.0),
    transfer=CallCost(fixed=0.0, per_byte=1e-9),
    sources=("round numbers for a test",),
)


async def test_calls_take_the_modelled_time(autojump_clock: trio.testing.MockClock) -> None:
    fabric = InMemoryFabric()
    sender, receiver = fabric.engine("s"), fabric.engine("r")
    sender.apply_costs(FLAT)
    source = torch.ones(1_000_000, dtype=torch.uint8)
    dest = torch.zeros(1_000_000, dtype=torch.uint8)
    await receiver.register(int(dest.data_ptr()), dest.numel())

    start = trio.current_time()
    await sender.register(int(source.data_ptr()), source.numel())
    assert trio.current_time() - start == pytest.approx(2e-3)  # 1 ms + 1 MB x 1 ns
    start = trio.current_time()
    await sender.transfer(
        Write(receiver.session_id, [(int(source.data_ptr()), 10**6)], int(dest.data_ptr()))
    )
    assert trio.current_time() - start == pytest.approx(1e-3)
    assert bool(dest.all())
    start = trio.current_time()
    await sender.deregister(int(source.data_ptr()))
    assert trio.current_time() - start == pytest.approx(0.5e-3)


async def test_transfers_from_one_engine_share_its_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two 1 MB transfers at once take as long as 2 MB: the link's bandwidth is shared."""
    fabric = InMemoryFabric()
    sender = fabric.engine("s")
    sender.apply_costs(FLAT)
    source = torch.ones(1_000_000, dtype=torch.uint8)
    await sender.register(int(source.data_ptr()), source.numel())
    ranks = [fabric.engine(f"r{i}") for i in range(2)]
    buffers = [torch.zeros(1_000_000, dtype=torch.uint8) for _ in ranks]
    for rank, buffer in zip(ranks, buffers, strict=True):
        await rank.register(int(buffer.data_ptr()), buffer.numel())
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for rank, buffer in zip(ranks, buffers, strict=True):
            write = Write(
                rank.session_id, [(int(source.data_ptr()), 10**6)], int(buffer.data_ptr())
            )
            nursery.start_soon(sender.transfer, write)
    assert trio.current_time() - start == pytest.approx(2e-3)


def test_the_modelled_run_registers_nothing_per_request_with_the_arena() -> None:
    result = run_model(RDMA, [1_000_000], [1, 4], requests=8)
    by_path = {(row.path, row.tp): row for row in result.rows}
    for tp in (1, 4):
        arena, plain = by_path[PATHS[0], tp], by_path[PATHS[1], tp]
        assert arena.registrations == 0
        assert arena.register_seconds == 0
        assert plain.registrations == 8
        assert plain.register_seconds == pytest.approx(
            8 * (RDMA.register.seconds(10**6) + RDMA.deregister.seconds(10**6))
        )
        assert arena.requests_per_second > plain.requests_per_second
    # One rank: registration sits on every request's critical path.
    assert by_path[PATHS[0], 1].requests_per_second > 2 * by_path[PATHS[1], 1].requests_per_second


def test_the_modelled_table_says_it_is_a_model_and_cites_its_figures() -> None:
    text = run_model(RDMA, [1_000_000], [1], requests=2).table()
    assert text.startswith("MODEL, not a measurement")
    assert "pull request 855" in text


def test_the_video_row_times_every_side(tmp_path: Path) -> None:
    settings = EncoderSettings(
        model=save_tiny_qwen2_5_vl(tmp_path), max_batch_size=2, cache_bytes=0, warmup=False
    )
    config = BenchConfig(
        encoder=settings,
        concurrency=2,
        rounds=2,
        raw_seconds=0.2,
        served_seconds=0.6,
        progress=False,
    )
    backend = load_backend(settings)
    row = trio.run(_video_row, config, Progress(False), settings, backend)

    assert (row.batch_size, row.concurrency) == (2, 2)
    assert row.frames == 8  # 4 s at SGLang's 2 frames a second
    assert row.tokens > 0
    assert row.served_videos > 0
    assert 0 < row.mean_batch <= 2
    assert row.decode_videos == 2 * 4  # rounds x decodings a round
    for value in (row.raw_frame_rate, row.served_frame_rate, row.ratio, row.decode_share):
        assert math.isfinite(value)
        assert value > 0
    result = BenchResult("m", 2, 1, [], None, None, 0, 0, 0, 1.0, video=row)
    (line,) = [line for line in result.table().splitlines() if line.startswith("video m, B=2")]
    assert f"ratio {row.ratio:.2f}" in line
    assert f"{row.decode_share:.0%} of the served time" in result.table()
    assert result.to_json()["video"]["ratio"] == row.ratio


def test_each_caller_of_the_video_row_has_its_own_video() -> None:
    """Identical videos in flight share a forward, so callers sending the same bytes would make
    the served rate count work never done. The bench's videos differ in content and are alike
    in size and length, so each costs the same."""
    frames = [decode_video(video).frames for video in bench_videos(3)]
    assert {video.shape for video in frames} == {(8, 240, 320, 3)}
    for index, video in enumerate(frames):
        for other in frames[index + 1 :]:
            # Far apart, not merely unequal: the encoder's threads may code one content twice
            # with slightly different pixels.
            assert np.abs(video.astype(np.int16) - other.astype(np.int16)).mean() > 8


def test_the_video_rows_rates_ratio_and_decoding_share() -> None:
    """Frames/s of each side, and decoding's share: one video's decoding (50 ms) over the
    served time one video takes (4 s for 20: 200 ms)."""
    row = VideoRow(
        batch_size=4,
        concurrency=4,
        frames=8,
        tokens=560,
        video_bytes=1,
        raw_videos=10,
        raw_seconds=1.0,
        served_videos=20,
        served_seconds=4.0,
        served_batches=8,
        served_videos_in_batches=20,
        served_forward_seconds=3.0,
        decode_videos=10,
        decode_seconds=0.5,
        raw_spread=(80.0, 80.0),
        served_spread=(40.0, 40.0),
    )
    assert row.raw_frame_rate == 80
    assert row.served_frame_rate == 40
    assert row.ratio == 0.5
    assert row.decode_share == pytest.approx(0.25)
    assert row.mean_batch == 2.5
    assert row.forward_busy == 0.75
    text = BenchResult("m", 1, 1, [], None, None, 0, 0, 0, 1.0, video=row).table()
    assert "raw 80.0 frames/s (one video a forward), served 40.0 frames/s, ratio 0.50 " in text
    assert "(below 0.9)" in text
    assert "raw 5600 tokens/s, served 2800 tokens/s; decoding 25% of the served time" in text
