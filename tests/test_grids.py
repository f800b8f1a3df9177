"""Per-image grids: what the encoder reports with an embedding, and SGLang's ``grid_dim``."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from support.lifecycle_rig import gather_sends, lifecycle_rig, make_embedding
from trio_encode.embedding import Embedding, RowsEmbedding
from trio_encode.request_types import Media, SendReport, grid_dim


def test_grid_dim_is_none_for_a_fixed_grid_model() -> None:
    assert grid_dim([]) is None
    assert grid_dim([None, None]) is None


def test_grid_dim_lists_each_images_grid_in_order() -> None:
    assert grid_dim([(1, 28, 42), (1, 14, 14)]) == [[1, 28, 42], [1, 14, 14]]


def test_every_image_has_a_grid_or_none_has() -> None:
    with pytest.raises(ValueError, match="every image has a grid or none"):
        Embedding(torch.zeros(4, 8), ((1, 2, 2), None))


def test_a_copy_keeps_the_grids() -> None:
    embedding = Embedding(torch.zeros(4, 8), ((1, 2, 2),))
    assert embedding.copy().grids == ((1, 2, 2),)


async def test_the_grids_outlive_the_embedding_in_every_send_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with lifecycle_rig() as rig:
        embedding = Embedding(make_embedding(1).tensor, ((1, 4, 4), (1, 4, 4)))
        script, _ = rig.encoder("r", embedding)
        del embedding
        await rig.open("r", script, receive_count=1)
        (landing,) = await rig.landings(1)
        (report,) = await gather_sends(rig, "r", [landing.receiver])
        assert isinstance(report, SendReport)
        assert report.shape.grids == ((1, 4, 4), (1, 4, 4))
        assert grid_dim(report.shape.grids) == [[1, 4, 4], [1, 4, 4]]
        await rig.assert_nothing_held()


VIDEO = Media("VIDEO", (("video_timestamps", [[0.25, 1.25]]), ("second_per_grid_ts", [1.0])))


def test_a_copy_keeps_the_parts_modality_and_metadata() -> None:
    embedding = Embedding(torch.zeros(4, 8), ((2, 2, 4),), media=VIDEO)
    assert embedding.copy().media == VIDEO
    rows = RowsEmbedding([torch.zeros(4, 8)], ((2, 2, 4),), media=VIDEO)
    assert rows.copy().media == VIDEO


async def test_a_video_parts_modality_and_metadata_outlive_the_embedding(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """What the completion message of a video part needs is in every send answer's shape."""
    async with lifecycle_rig() as rig:
        embedding = Embedding(make_embedding(1).tensor, ((2, 4, 8),), media=VIDEO)
        script, _ = rig.encoder("r", embedding)
        del embedding
        await rig.open("r", script, receive_count=1)
        (landing,) = await rig.landings(1)
        (report,) = await gather_sends(rig, "r", [landing.receiver])
        assert isinstance(report, SendReport)
        assert report.shape.media == VIDEO
        assert report.shape.grids == ((2, 4, 8),)
        await rig.assert_nothing_held()
