"""The bounded memory of ended and failed requests: by count and by age, oldest first."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_encode.recent import Recent


async def test_the_oldest_entry_goes_first_past_the_limit() -> None:
    recent: Recent[str, int] = Recent(2, 60.0)
    for i, key in enumerate("abc"):
        recent.remember(key, i)
    assert len(recent) == 2
    assert [recent.get(k) for k in "abc"] == [None, 1, 2]


async def test_remembering_a_key_again_makes_it_the_newest() -> None:
    recent: Recent[str, int] = Recent(2, 60.0)
    recent.remember("a", 0)
    recent.remember("b", 1)
    recent.remember("a", 2)
    recent.remember("c", 3)
    assert [recent.get(k) for k in "abc"] == [2, None, 3]


async def test_an_entry_is_forgotten_after_its_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    window = [10.0]
    recent: Recent[str, int] = Recent(100, lambda: window[0])
    recent.remember("a", 0)
    await trio.sleep(9)
    assert recent.get("a") == 0
    await trio.sleep(2)
    assert recent.get("a") is None
    recent.remember("b", 1)  # remembering prunes what has aged out
    assert len(recent) == 1
    window[0] = 1.0  # the window is read at each use (a setting's current value)
    await trio.sleep(2)
    assert recent.get("b") is None


async def test_forget_and_a_zero_limit() -> None:
    recent: Recent[str, int] = Recent(0, 60.0)
    recent.remember("a", 0)
    assert recent.get("a") is None
    kept: Recent[str, int] = Recent(1, 60.0)
    kept.remember("a", 0)
    kept.forget("a")
    kept.forget("never")
    assert kept.get("a") is None
    with pytest.raises(ValueError, match="limit"):
        Recent(-1, 1.0)
