"""SGLang's completion message: our bytes, loaded by an unpickler that follows the rule of
SGLang 0.5.23's ``safe_pickle_loads`` (``support.sglang_pickle``), checked field by field
against what SGLang's own encoder sends."""

from __future__ import annotations

import pickle
import pickletools

import pytest
import torch

from support.sglang_pickle import ALLOWED, EmbeddingData, Modality, safe_loads
from trio_encode.completion import CompletionMessage


def globals_named(data: bytes) -> set[tuple[str, str]]:
    named = set()
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL":
            module, name = str(arg).split(" ", 1)
            named.add((module, name))
    return named


def test_a_done_message_loads_as_sglangs_own_encoder_would_send_it() -> None:
    message = CompletionMessage(
        "rid_local_part_1", 2, 1, grid_dim=None, shape=(128, 3584), dtype="bfloat16"
    )
    data = message.to_bytes()
    loaded = safe_loads(data)

    staged = EmbeddingData(
        "rid_local_part_1", 2, 1, None, Modality.IMAGE, torch.empty(128, 3584, dtype=torch.bfloat16)
    )
    expected = staged.copy_without_embedding()
    assert type(loaded) is EmbeddingData
    assert list(loaded.__dict__) == list(expected.__dict__)  # the same fields, in its order
    assert loaded.__dict__ == expected.__dict__
    assert loaded.modality is Modality.IMAGE
    assert loaded.dtype is torch.bfloat16
    assert loaded.shape == [128, 3584]
    assert loaded.error_msg is None
    assert globals_named(data) <= ALLOWED


def test_grids_travel_as_lists_sglang_turns_into_its_grid_tensor() -> None:
    message = CompletionMessage(
        "r", 1, 0, grid_dim=[(1, 28, 42), (1, 14, 14)], shape=(441, 8), dtype="float32"
    )
    loaded = safe_loads(message.to_bytes())
    assert loaded.grid_dim == [[1, 28, 42], [1, 14, 14]]
    # What SGLang's receiver does with a part's grid (``_cat_grid``): one (images, 3) tensor.
    grid = torch.cat([torch.as_tensor(loaded.grid_dim)], dim=0)
    assert grid.tolist() == [[1, 28, 42], [1, 14, 14]]
    assert loaded.dtype is torch.float32


def test_an_error_message_carries_the_message_and_code_and_no_shape() -> None:
    message = CompletionMessage.failed("r_local_part_0", 2, 0, "mm_items[0]: not an image", 400)
    loaded = safe_loads(message.to_bytes())
    expected = EmbeddingData(
        "r_local_part_0",
        2,
        0,
        None,
        Modality.IMAGE,
        error_msg="mm_items[0]: not an image",
        error_code=400,
    ).copy_without_embedding()
    assert loaded.__dict__ == expected.__dict__
    assert loaded.error_code == 400
    assert loaded.shape is None
    assert loaded.dtype is None


def test_the_fields_pass_sglangs_part_checks() -> None:
    """SGLang's ``_validate_embedding_part``: ints (not bools), 0 <= part_idx < num_parts."""
    loaded = safe_loads(CompletionMessage("r", 3, 2, shape=(1, 1), dtype="float16").to_bytes())
    assert type(loaded.num_parts) is int
    assert type(loaded.part_idx) is int
    assert 0 <= loaded.part_idx < loaded.num_parts
    with pytest.raises(ValueError, match="part_idx"):
        CompletionMessage("r", 2, 2, shape=(1, 1), dtype="float16")


def test_any_other_global_is_refused_by_the_rule() -> None:
    """The rule the test unpickler follows really refuses: ``pickle.dumps`` of a set names
    ``builtins.set``, which is not among the entries listed here."""
    with pytest.raises(RuntimeError, match="Blocked"):
        safe_loads(pickle.dumps({1}, protocol=2))


def test_strings_and_big_numbers_round_trip() -> None:
    text = "ошибка: \u00e9\n" * 3
    message = CompletionMessage.failed("r\u00e9", 1, 0, text, 500)
    loaded = safe_loads(message.to_bytes())
    assert loaded.error_msg == text
    assert loaded.req_id == "r\u00e9"
    big = CompletionMessage("r", 1, 0, shape=(2**40, 7), dtype="float32")
    assert safe_loads(big.to_bytes()).shape == [2**40, 7]


def test_a_video_part_carries_its_modality_grid_and_metadata_as_sglangs_encoder_sends_them() -> (
    None
):
    """A video part: ``Modality.VIDEO``, its ``video_grid_thw`` as the grid, and its
    ``video_timestamps`` and ``second_per_grid_ts`` as attributes after the standard fields,
    in the order SGLang's encoder passes them."""
    timestamps = [[0.25, 1.25, 2.25]]
    seconds = [1.0]
    message = CompletionMessage(
        "rid_local_part_1",
        2,
        1,
        grid_dim=[(3, 16, 24)],
        shape=(288, 64),
        dtype="float32",
        modality="VIDEO",
        meta=(("video_timestamps", timestamps), ("second_per_grid_ts", seconds)),
    )
    data = message.to_bytes()
    loaded = safe_loads(data)
    staged = EmbeddingData(
        "rid_local_part_1",
        2,
        1,
        [[3, 16, 24]],
        Modality.VIDEO,
        torch.empty(288, 64),
        video_timestamps=timestamps,
        second_per_grid_ts=seconds,
    )
    expected = staged.copy_without_embedding()
    assert list(loaded.__dict__) == list(expected.__dict__)
    assert loaded.__dict__ == expected.__dict__
    assert loaded.modality is Modality.VIDEO
    assert globals_named(data) <= ALLOWED


@pytest.mark.parametrize("value", [0.0, -1.5, 1 / 3, 1e300])
def test_floats_round_trip_exactly(value: float) -> None:
    message = CompletionMessage(
        "r", 1, 0, shape=(1, 1), dtype="float32", modality="VIDEO",
        meta=(("second_per_grid_ts", [value]),),
    )  # fmt: skip
    assert safe_loads(message.to_bytes()).second_per_grid_ts == [value]


def test_an_unknown_modality_or_metadata_name_is_refused() -> None:
    with pytest.raises(ValueError, match="modality"):
        CompletionMessage("r", 1, 0, shape=(1, 1), dtype="float32", modality="SMELL")
    with pytest.raises(ValueError, match="metadata"):
        CompletionMessage("r", 1, 0, shape=(1, 1), dtype="float32", meta=(("rope", 1),))
