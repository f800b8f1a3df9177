"""Rendezvous ranking: the same content ranks the encoders the same way everywhere, keys are
spread evenly, and a change to the list moves only the keys it must."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

from trio_encode.client.ranking import content_digest, rank

ENCODERS = [f"http://10.0.0.{i}:8000" for i in range(1, 9)]
KEYS = [content_digest([f"data:image/png;base64,image-{i}"]) for i in range(4000)]


def test_the_ranking_depends_only_on_content_and_the_set_of_encoders() -> None:
    digest = content_digest(["a", "b"])
    first = rank(ENCODERS, digest)
    assert sorted(first) == sorted(ENCODERS)
    assert rank(reversed(ENCODERS), digest) == first  # order of the list does not matter
    assert rank(ENCODERS + ENCODERS[:2], digest) == first  # nor duplicates
    assert content_digest(["a", "b"]) != content_digest(["b", "a"])
    assert content_digest(["ab"]) != content_digest(["a", "b"])


def test_another_process_ranks_the_same_way() -> None:
    # Siblings are separate processes: the score must not depend on Python's hash seed.
    code = (
        "from trio_encode.client.ranking import content_digest, rank;"
        f"print(rank({ENCODERS!r}, content_digest(['x', 'y'])))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": "123", "PYTHONPATH": ":".join(sys.path)},
    )
    assert other.stdout.strip() == repr(rank(ENCODERS, content_digest(["x", "y"])))


def test_keys_spread_evenly() -> None:
    load = Counter(rank(ENCODERS, key)[0] for key in KEYS)
    share = len(KEYS) / len(ENCODERS)
    assert set(load) == set(ENCODERS)
    assert all(0.8 * share < count < 1.2 * share for count in load.values()), load


def test_removing_an_encoder_moves_only_its_keys_to_their_second_choice() -> None:
    gone = ENCODERS[3]
    smaller = [e for e in ENCODERS if e != gone]
    for key in KEYS:
        before = rank(ENCODERS, key)
        after = rank(smaller, key)
        assert after == [e for e in before if e != gone]  # everyone else keeps their place


def test_adding_an_encoder_moves_about_one_share_of_keys_all_to_it() -> None:
    new = "http://10.0.0.9:8000"
    moved = 0
    for key in KEYS:
        before, after = rank(ENCODERS, key)[0], rank([*ENCODERS, new], key)[0]
        if before != after:
            assert after == new
            moved += 1
    expected = len(KEYS) / (len(ENCODERS) + 1)
    assert 0.8 * expected < moved < 1.2 * expected
