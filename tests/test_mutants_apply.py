"""Every mutant in ``mutants.py`` still applies to the code and names killers that exist.

CI runs the mutants against their killers (``nox -s mutants``). These checks keep that run
honest: a refactor of the lifecycle must update its mutant rather than silently retire it, and
a renamed test must be renamed among the killers too (a killer that is not found, or that is
expected to fail anyway, would kill nothing).
"""

from __future__ import annotations

import ast

import pytest

from mutants import MUTANTS, ROOT


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_still_applies(name: str) -> None:
    for file, old, new in MUTANTS[name].edits():
        source = (ROOT / "src" / "trio_encode" / file).read_text()
        assert source.count(old) == 1, f"mutant {name!r} no longer matches {file}"
        assert old != new


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_killers_are_tests_expected_to_pass(name: str) -> None:
    killers = MUTANTS[name].killers
    assert killers, f"mutant {name!r} names no killers"
    for killer in killers:
        path, _, function = killer.partition("::")
        function = function.partition("[")[0]  # a parametrised test's case: its function
        tree = ast.parse((ROOT / path).read_text())
        found = [
            node
            for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function
        ]
        assert found, f"killer {killer} of mutant {name!r} does not exist"
        marks = [ast.unparse(d) for d in found[0].decorator_list]
        assert not any("xfail" in mark for mark in marks), f"killer {killer} is an xfail"
