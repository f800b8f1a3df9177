"""What a late call gets, as one table: the tombstone first, then shutdown, then failures.

The lifecycle suites prove each answer end to end; this pins the order of the decision,
which is where a second place deciding it would drift."""

from __future__ import annotations

import pytest

from trio_encode.ending import Call, Ended, Failure, late_call, refusal
from trio_encode.errors import (
    EncodeFailed,
    InvalidInput,
    RequestReleased,
    ScopeExpired,
    ShuttingDown,
)
from trio_encode.request_types import EmbeddingShape, Receiver

SHAPE = EmbeddingShape(4, 8, 128, "float32", "xxh3:00")
SERVED = Receiver("rank0:1", 0x1000)
OTHER = Receiver("rank1:1", 0x2000)
CALLS: tuple[Call, ...] = ("encode", "pull", "send")


def completed(*, gone: bool = True) -> Ended:
    return Ended("completed", None, SHAPE, frozenset({SERVED}), 1, gone=gone)


def test_a_served_receiver_gets_its_answer_again_and_any_other_the_end() -> None:
    again = late_call("send", "r", completed(), receiver=SERVED)
    assert again is not None
    assert again.repeat
    assert (again.receivers_done, again.receive_count) == (1, 1)
    with pytest.raises(RequestReleased, match="released"):
        late_call("send", "r", completed(), receiver=OTHER)


@pytest.mark.parametrize("call", CALLS)
def test_a_tombstone_answers_before_shutdown_and_before_remembered_failures(call: Call) -> None:
    failed = Ended("encode_failed", Failure(EncodeFailed, "the vision tower raised"), None,
                   frozenset(), None, gone=True)  # fmt: skip
    with pytest.raises(EncodeFailed, match="vision tower"):
        late_call(call, "r", failed, closed=True, failure=Failure(InvalidInput, "other"))


@pytest.mark.parametrize("call", CALLS)
def test_without_a_tombstone_shutdown_comes_before_failures(call: Call) -> None:
    with pytest.raises(ShuttingDown):
        late_call(call, "r", None, closed=True, failure=Failure(InvalidInput, "bad"))


def test_a_remembered_bad_input_is_not_held_against_a_corrected_encode() -> None:
    bad = Failure(InvalidInput, "mm_items[0]: cannot decode the image")
    assert late_call("encode", "r", None, failure=bad) is None
    for call in ("pull", "send"):
        with pytest.raises(InvalidInput, match="cannot decode"):
            late_call(call, "r", None, failure=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("call", CALLS)
def test_a_failed_sibling_part_ends_every_call_for_its_parts(call: Call) -> None:
    sibling = Failure(EncodeFailed, "part 0 of this request failed: oom")
    with pytest.raises(EncodeFailed, match="part 0"):
        late_call(call, "r_local_part_1", None, family_failure=sibling)


@pytest.mark.parametrize("call", CALLS)
def test_a_request_never_seen_goes_on(call: Call) -> None:
    assert late_call(call, "r", None) is None


def test_a_scope_still_ending_says_why() -> None:
    def ending(reason: str | None) -> Ended:
        return Ended(reason, None, SHAPE, frozenset({SERVED}), 2)  # type: ignore[arg-type]

    assert isinstance(refusal("r", ending("expired")), ScopeExpired)
    assert "1 of 2 receivers" in refusal("r", ending("expired")).message
    assert "complete" in refusal("r", ending("completed")).message
    assert isinstance(refusal("r", ending("shutdown")), ShuttingDown)
    assert isinstance(refusal("r", ending(None)), ShuttingDown)
    assert "(abandoned)" in refusal("r", ending("abandoned")).message
    assert (
        "already been released (expired)"
        in refusal("r", Ended("expired", None, SHAPE, frozenset(), 2, gone=True)).message
    )
