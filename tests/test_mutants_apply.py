"""Every mutant in ``mutants.py`` still applies to the code (``nox -s mutants`` runs them).

Running the mutants takes minutes, so CI only checks that each one still finds the exact text
it replaces: a refactor of the lifecycle must update its mutant, not silently retire it.
"""

from __future__ import annotations

import pytest

from mutants import MUTANTS, ROOT


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_still_applies(name: str) -> None:
    filename, old, new = MUTANTS[name]
    source = (ROOT / "src" / "trio_encode" / filename).read_text()
    assert source.count(old) == 1, f"mutant {name!r} no longer matches {filename}"
    assert old != new
