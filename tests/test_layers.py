"""The package's layers as a rule: a module imports only its own unit and units below it.

The product (HTTP -> service -> scopes -> ledger / encoder -> engine) never imports the tools
wing (demo, fleet demo, bench, soak) or the test doubles; those sit above it, and only the
command line sits above them. A new arrow that points up fails here, naming the import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import trio_encode

PACKAGE = Path(trio_encode.__file__).parent

LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(units.split())
    for units in (
        "__main__",  # `python -m trio_encode`
        "cli",  # the command line: every command, so it may reach everything
        "tools",  # demo, fleet demo, bench, soak
        "testing",  # test doubles and drivers: the in-memory engine, fault injection, costs
        "server",  # HTTP: the app, its errors and metrics, hypercorn
        "logs",  # log set-up: the sink that never blocks, and its count of dropped lines
        "options",  # the command line's options, generated from the settings
        "settings",  # every setting of `serve`, gathered from the layers that obey them
        "service",  # the service nursery: scopes, pulls, the encoder and the engine together
        "scopes",  # the live scopes, by req_id
        "scope arrivals completion receivers",  # a request's life; pulls; completion; receivers
        "request_state held",  # a request's state and what a late call gets; held memory
        "ledger",  # at most one live registration for any byte
        "client",  # the prefill side's client (beside the server, never importing it)
        "encoder",  # images -> embeddings, the cache, the store
        "embedding",
        "arena",
        "errors",
        "engine",  # the transfer engine interface and Mooncake
        "request_types observer declare sizes addresses recent __version__",
    )
)
"""Highest first. A unit is a top-level module or subpackage of ``trio_encode``."""

RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """``trio_encode.encoder.front`` -> ``encoder``; ``trio_encode`` itself -> ``__version__``
    (all the package's ``__init__`` holds)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__version__"


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for every ``trio_encode`` import in the file, nested ones included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "trio_encode":
                for alias in node.names:
                    yield node.lineno, f"trio_encode.{alias.name}"
            elif node.module.startswith("trio_encode."):
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("trio_encode."):
                    yield node.lineno, alias.name


def violations(module: str, imported: str) -> str | None:
    """Why ``module`` may not import ``imported`` (``None`` when it may)."""
    source, target = unit_of(module), unit_of(imported)
    if source == target:
        return None
    for unit in (source, target):
        if unit not in RANK:
            return f"{unit!r} is in no layer: add it to LAYERS"
    if RANK[target] <= RANK[source]:
        return f"{source} (layer {RANK[source]}) may not import {target} (layer {RANK[target]})"
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_import_points_down() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {reason}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, imported in imports(path)
        if (reason := violations(module_name(path), imported)) is not None
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("module", "imported"),
    [
        ("trio_encode.server.app", "trio_encode.tools.demo"),
        ("trio_encode.settings", "trio_encode.testing.faults"),
        ("trio_encode.engine.mooncake", "trio_encode.scope"),
        ("trio_encode.client.fleet", "trio_encode.server.app"),
        ("trio_encode.encoder.front", "trio_encode.somewhere_new"),
    ],
)
def test_an_arrow_that_points_up_is_refused(module: str, imported: str) -> None:
    assert violations(module, imported) is not None


def test_the_rule_reads_nested_imports(tmp_path: Path) -> None:
    """A lazy import inside a function is an arrow too."""
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from trio_encode.tools.bench import run\n")
    assert list(imports(source)) == [(2, "trio_encode.tools.bench")]


def module_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules it imports (nested imports too; imports for
    type checking only are no arrows at run time and are left out)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, ast.ImportFrom):
                continue
            if node.module is None or node.level or not node.module.startswith("trio_encode"):
                continue
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                targets.add(full if full in modules else node.module)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a circle."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def test_no_modules_import_each_other_around_a_circle() -> None:
    assert circles(module_graph()) == []


def test_a_circle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


SERVE_COMMAND = ("serve", "_serve_settings", "_stopped", "_run")
"""The functions of ``cli.py`` that ``trio-encode serve`` runs."""


def test_the_serve_command_imports_nothing_from_the_tools_or_the_test_doubles() -> None:
    """The drills compose a server of their own (``drill-serve``); ``serve`` is the product."""
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    functions = {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in SERVE_COMMAND
    }
    assert set(functions) == set(SERVE_COMMAND)
    found = [
        f"{name}: {node.module}"
        for name, function in functions.items()
        for node in ast.walk(function)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith(("trio_encode.testing", "trio_encode.tools"))
    ]
    decorators = [
        ast.unparse(decorator)
        for decorator in functions["serve"].decorator_list
        if "drill" in ast.unparse(decorator)
    ]
    assert not found, found
    assert not decorators, decorators
