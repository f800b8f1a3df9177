"""A request's state as a table, and what a late call gets, as one function: the tombstone
first, then shutdown, then a bad input's failure, then a failed sibling part, then 404.

The lifecycle suites prove each answer end to end; this pins the table and the order of the
decision, which is where a second place deciding it would drift."""

from __future__ import annotations

import pytest

from trio_encode.errors import (
    EncodeFailed,
    InvalidInput,
    ReceiveCountConflict,
    RequestReleased,
    ScopeExpired,
    ShuttingDown,
    UnknownRequest,
)
from trio_encode.request_state import (
    TRANSITIONS,
    Call,
    Ended,
    Failure,
    IllegalMove,
    RequestState,
    answer,
    refusal,
)
from trio_encode.request_types import EmbeddingShape, Receiver

SHAPE = EmbeddingShape(4, 8, 128, "float32", "xxh3:00")
SERVED = Receiver("rank0:1", 0x1000)
OTHER = Receiver("rank1:1", 0x2000)
CALLS: tuple[Call, ...] = ("encode", "pull", "send")


def completed(*, gone: bool = True) -> Ended:
    return Ended("completed", None, SHAPE, frozenset({SERVED}), 1, gone=gone)


def bad_input() -> Ended:
    failure = Failure(InvalidInput, "mm_items[0]: cannot decode the image")
    return Ended("invalid_input", failure, None, frozenset(), None, gone=True)


def test_a_served_receiver_gets_its_answer_again_and_any_other_the_end() -> None:
    again = answer("send", "r", completed(), receiver=SERVED)
    assert again is not None
    assert again.repeat
    assert (again.receivers_done, again.receive_count) == (1, 1)
    with pytest.raises(RequestReleased, match="released"):
        answer("send", "r", completed(), receiver=OTHER)


@pytest.mark.parametrize("call", CALLS)
def test_a_tombstone_answers_before_shutdown_and_before_a_failed_sibling(call: Call) -> None:
    failed = Ended("encode_failed", Failure(EncodeFailed, "the vision tower raised"), None,
                   frozenset(), None, gone=True)  # fmt: skip
    with pytest.raises(EncodeFailed, match="vision tower"):
        answer(call, "r", failed, closed=True, family_failure=Failure(InvalidInput, "other"))


@pytest.mark.parametrize("call", ["encode", "pull"])
def test_shutdown_comes_before_a_bad_inputs_failure(call: Call) -> None:
    with pytest.raises(ShuttingDown):
        answer(call, "r", bad_input(), closed=True)


def test_a_send_on_a_closing_server_still_learns_why_its_request_is_gone() -> None:
    with pytest.raises(InvalidInput):
        answer("send", "r", bad_input(), closed=True)
    with pytest.raises(UnknownRequest):
        answer("send", "r", None, closed=True)


def test_a_remembered_bad_input_is_not_held_against_a_corrected_encode() -> None:
    assert answer("encode", "r", bad_input()) is None
    for call in ("pull", "send"):
        with pytest.raises(InvalidInput, match="cannot decode"):
            answer(call, "r", bad_input())  # type: ignore[arg-type]


def test_a_bad_input_still_ending_answers_its_own_encode_siblings() -> None:
    """Only the tombstone of a retriable end lets a new /encode through: while the scope
    still ends, the /encode calls that joined it get its failure."""
    ending = Ended("invalid_input", Failure(InvalidInput, "bad"), None, frozenset(), None)
    with pytest.raises(InvalidInput):
        answer("encode", "r", ending)


@pytest.mark.parametrize("call", CALLS)
def test_a_failed_sibling_part_ends_every_call_for_its_parts(call: Call) -> None:
    sibling = Failure(EncodeFailed, "part 0 of this request failed: oom")
    with pytest.raises(EncodeFailed, match="part 0"):
        answer(call, "r_local_part_1", None, family_failure=sibling)


@pytest.mark.parametrize("call", ["encode", "pull"])
def test_a_request_never_seen_goes_on(call: Call) -> None:
    assert answer(call, "r", None) is None


def test_a_send_for_a_request_never_seen_is_404() -> None:
    with pytest.raises(UnknownRequest):
        answer("send", "r", None)


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


def test_the_first_end_reason_and_failure_stand() -> None:
    state = RequestState("r", deadline=10.0, receive_count=None)
    state.encoded(SHAPE)
    assert state.end("completed") == "completed"
    assert state.end("shutdown", Failure(EncodeFailed, "late")) == "completed"
    assert state.failure == Failure(EncodeFailed, "late")  # the first failure, even after
    assert state.end("failed", Failure(InvalidInput, "later")) == "completed"
    assert state.failure == Failure(EncodeFailed, "late")
    tombstone = state.release()
    assert (tombstone.gone, tombstone.reason, tombstone.shape) == (True, "completed", SHAPE)


def test_an_encode_that_returns_after_the_end_publishes_nothing() -> None:
    state = RequestState("r", deadline=10.0, receive_count=1)
    state.end("abandoned")
    state.encoded(SHAPE)
    assert state.shape is None
    assert not state.serving


def test_moves_outside_the_table_are_refused() -> None:
    state = RequestState("r", deadline=10.0, receive_count=1)
    with pytest.raises(IllegalMove):
        state.release()  # still encoding
    state.encoded(SHAPE)
    with pytest.raises(IllegalMove):
        state.encoded(SHAPE)  # one encode per request
    state.end("completed")
    state.release()
    for event in ("encoded", "end", "release"):
        assert ("gone", event) not in TRANSITIONS
    with pytest.raises(IllegalMove):
        state.end("shutdown")


def test_the_count_is_fixed_once_and_completion_follows_it() -> None:
    state = RequestState("r", deadline=10.0, receive_count=None)
    state.name_count(None)
    assert state.receive_count is None
    state.name_count(2)
    with pytest.raises(ReceiveCountConflict):
        state.name_count(3)
    assert not state.receiver_done(SERVED)
    assert not state.receiver_done(SERVED)  # a retry is not a new receiver
    assert state.receiver_done(OTHER)


def test_past_its_deadline_an_unmarked_end_reads_as_expired() -> None:
    state = RequestState("r", deadline=10.0, receive_count=2)
    assert state.ended(now=9.0).reason is None
    assert state.ended(now=10.0).reason == "expired"
