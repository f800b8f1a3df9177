"""How one setting is declared: a pydantic field that also carries where ``--help`` lists it.

Every setting of the package is a field made by :func:`setting` (through :func:`in_group`, so a
model names each ``--help`` section once) in the settings model of the layer that obeys it (the
scopes, the engine, the encoder, the HTTP server), a model configured with :data:`SETTINGS`. Its
type, default and bounds are stated there once, and its help is the field's docstring; the
command line, the ``TRIO_ENCODE_*`` variables, the config file and the docs are all generated
from that field, so adding a setting is adding a field and its docstring.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pydantic import ConfigDict

GROUPS = ("server", "engine", "model", "batching", "cache", "logging")
"""The ``--help`` sections of the product's settings, in the order they are shown. A tool
names its own section where its settings are declared (``in_group("soak")``): the product
knows none of them, and :func:`sections` shows a command's own before these."""

SETTINGS: ConfigDict = {"extra": "forbid", "use_attribute_docstrings": True}
"""The config of every settings model: unknown keys are refused, and each field's docstring is
its help."""


def sections(names: Iterable[str]) -> list[str]:
    """``names`` (sections one command shows) in the order its ``--help`` lists them: the
    command's own first, as they come, then the product's in the order of :data:`GROUPS`."""
    unique = list(dict.fromkeys(names))
    own = [name for name in unique if name not in GROUPS]
    return own + [name for name in GROUPS if name in unique]


def setting(
    default: Any = None,
    *,
    group: str,
    flags: tuple[str, ...] = (),
    **constraints: Any,
) -> Any:
    """A field listed in ``--help`` under ``group``; ``constraints`` are pydantic's (``gt``,
    ``ge``, ``le``, ``repr``, ``default_factory``...). ``flags`` are extra option names the
    setting is also known by (``--api-key`` for the token)."""
    from pydantic import Field

    extra: dict[str, Any] = {"group": group}
    if flags:
        extra["flags"] = list(flags)
    if "default_factory" in constraints:
        return Field(json_schema_extra=extra, **constraints)
    return Field(default, json_schema_extra=extra, **constraints)


class GroupSetting(Protocol):
    """:func:`setting` with its ``--help`` group already chosen."""

    def __call__(
        self, default: Any = None, *, flags: tuple[str, ...] = (), **constraints: Any
    ) -> Any: ...


def in_group(group: str) -> GroupSetting:
    """:func:`setting` for the fields of one ``--help`` section, so a settings model names its
    section once (``server_setting = in_group("server")``), not on every field."""

    def grouped_setting(
        default: Any = None, *, flags: tuple[str, ...] = (), **constraints: Any
    ) -> Any:
        return setting(default, group=group, flags=flags, **constraints)

    return grouped_setting


def comma_separated(value: Any) -> Any:
    """``"a, b"`` (how a list arrives in a flag or a variable) -> ``("a", "b")``; anything
    else (a list from the config file) is left for pydantic to check. A ``BeforeValidator``
    for tuple settings."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


def secret_in_file(path: Path, name: str) -> str:
    """The first line of ``path``, stripped: how a secret setting (``token_file``,
    ``store_key_file``) is read, so the secret shows neither on a command line nor in the
    environment. An unreadable or empty file is a :class:`ValueError` naming ``name`` and the
    path, never the file's contents."""
    try:
        lines = path.read_text().strip().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise ValueError(f"{name} {path}: {reason}") from None
    if not lines or not lines[0].strip():
        raise ValueError(f"{name} {path} is empty")
    return lines[0].strip()
