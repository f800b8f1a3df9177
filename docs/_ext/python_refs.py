"""Resolve the Python references that autodoc leaves dangling, by importing what they name.

Type hints and docstrings name objects the way the module that uses them imported them: a
bare ``EngineError`` in :mod:`trio_encode.ledger`, ``trio_encode.engine.EngineError``
(a re-export), ``Path``. Sphinx looks each up only under the name as written, so nitpicky mode
calls them all missing. This handler imports the name from the module the reference was written
in, finds where the object is defined, and links there. An object defined outside the package
(the standard library, Trio, torch...) is shown as plain text: the build fetches no other
project's inventory, so there is nothing to link to, and that is not an error. So is a private
name (``_Region``), which the reference does not document, and a type variable (``T``). A name
the import cannot reach (one imported only for type checking) links to the one documented
object whose name ends with it.
"""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

from docutils.nodes import Element
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment

PACKAGE = "trio_encode"


def _lookup(dotted: str) -> tuple[Any, str] | None:
    """The object a dotted name reaches, and the module it was reached through."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return None
        return obj, module_name
    return None


def _defined_as(dotted: str) -> str | None:
    """Where the object named ``dotted`` is defined: ``module.qualname``, or None."""
    found = _lookup(dotted)
    if found is None:
        return None
    obj, _ = found
    owner = obj
    suffix = ""
    # A method or attribute reached through its class is defined where its class is.
    if not hasattr(obj, "__qualname__") or not hasattr(obj, "__module__"):
        parent = _lookup(dotted.rsplit(".", 1)[0])
        if parent is None or not hasattr(parent[0], "__qualname__"):
            return None
        owner, suffix = parent[0], "." + dotted.rsplit(".", 1)[1]
    module = getattr(owner, "__module__", None)
    qualname = getattr(owner, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    return f"{module}.{qualname}{suffix}"


def _candidates(node: pending_xref) -> list[str]:
    target: str = node["reftarget"].lstrip("~.")
    module = node.get("py:module")
    cls = node.get("py:class")
    found = []
    if module and cls:
        found.append(f"{module}.{cls}.{target}")
    if module:
        found.append(f"{module}.{target}")
    found.append(target)
    return found


def resolve(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: Element
) -> Element | None:
    if node.get("refdomain") != "py":
        return None
    domain: Any = env.get_domain("py")
    documented = domain.objects
    for name in _candidates(node):
        found = _lookup(name)
        if found is not None and isinstance(found[0], TypeVar):
            return contnode  # a type variable (``T``) is a placeholder, not a page
        defined = _defined_as(name)
        if defined is None:
            continue
        if defined in documented:
            return domain.resolve_any_xref(
                env, node["refdoc"], app.builder, defined, node, contnode
            )[0][1]
        if not defined.startswith(PACKAGE + "."):
            return contnode
    target = node["reftarget"].lstrip("~.")
    if target.rsplit(".", 1)[-1].startswith("_"):
        return contnode
    endings = [name for name in documented if name.endswith("." + target)]
    if len(endings) == 1:
        return domain.resolve_any_xref(
            env, node["refdoc"], app.builder, endings[0], node, contnode
        )[0][1]
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", resolve)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
