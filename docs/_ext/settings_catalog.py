"""``.. settings-catalog::``: every setting as tables, one section per ``--help`` group.

The rows come from the same declarations the command line is generated from
(:func:`trio_encode.settings.catalog` for the server's settings, the ``demo``, ``bench``,
``fleet`` and ``soak`` commands' own models for theirs) and are shown the way ``--help``
shows them, so the page cannot drift from the flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

from trio_encode.declare import GROUPS
from trio_encode.options import command_settings, is_bool, metavar, shown_default
from trio_encode.settings import catalog
from trio_encode.tools.bench.settings import BenchConfig
from trio_encode.tools.demo import DemoSettings
from trio_encode.tools.fleet_demo import FleetDemoConfig
from trio_encode.tools.soak.run import SoakConfig

COMMANDS: tuple[type[Any], ...] = (DemoSettings, BenchConfig, FleetDemoConfig, SoakConfig)
"""The commands' own settings models, shown after the server's."""

HEADERS = ("flag", "variable", "config key", "type", "default", "help")
WIDTHS = (18, 22, 14, 10, 8, 28)

GROUP_INTROS = {
    "demo": "Flags of ``trio-encode demo`` only; the command line is their only source.",
    "bench": "Flags of ``trio-encode bench`` only; the command line is their only source.",
    "fleet": "Flags of ``trio-encode fleet`` only; the command line is their only source.",
    "soak": "Flags of ``trio-encode soak`` only; the command line is their only source.",
}


@dataclass(frozen=True)
class Row:
    """One setting as the reference shows it."""

    group: str
    flags: str
    variable: str | None
    config_key: str | None
    type: str
    default: str | None
    help: str


def rows() -> list[Row]:
    """Every setting of every command, in declaration order."""
    found = []
    own = [entry for model in COMMANDS for entry in command_settings(model)]
    for entry in [*catalog(), *own]:
        info = entry.info
        boolean = is_bool(info)
        flags = [f"{entry.flag} / --no-{entry.flag[2:]}" if boolean else entry.flag]
        flags += list(entry.aliases)
        found.append(
            Row(
                group=entry.group,
                flags=", ".join(flags),
                variable=entry.env,
                config_key=entry.name if entry.env else None,
                type="flag" if boolean else metavar(info),
                default=shown_default(info),
                help=entry.help,
            )
        )
    return found


def _cell(text: str | None, literal: bool) -> nodes.entry:
    entry = nodes.entry()
    if text is None:
        entry += nodes.paragraph(text="—")
    elif literal:
        entry += nodes.paragraph("", "", nodes.literal(text=text))
    else:
        entry += nodes.paragraph(text=text)
    return entry


def _table(group_rows: list[Row]) -> nodes.table:
    table = nodes.table(classes=["settings-table"])
    tgroup = nodes.tgroup(cols=len(HEADERS))
    table += tgroup
    for width in WIDTHS:
        tgroup += nodes.colspec(colwidth=width)
    head = nodes.row()
    for title in HEADERS:
        head += _cell(title, literal=False)
    tgroup += nodes.thead("", head)
    body = nodes.tbody()
    for row in group_rows:
        line = nodes.row()
        line += _cell(row.flags, literal=True)
        line += _cell(row.variable, literal=True)
        line += _cell(row.config_key, literal=True)
        line += _cell(row.type, literal=True)
        line += _cell(row.default, literal=True)
        line += _cell(row.help, literal=False)
        body += line
    tgroup += body
    return table


class SettingsCatalog(SphinxDirective):
    """Sections titled by ``--help`` group, each with a table of its settings: the server's
    groups, then the commands' own (``demo``, ``bench``, ``fleet``, ``soak``)."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        by_group: dict[str, list[Row]] = {}
        for row in rows():
            by_group.setdefault(row.group, []).append(row)
        sections: list[nodes.Node] = []
        # The server's groups first, in --help's order, then the commands' own as declared.
        shown = [group for group in GROUPS if group in by_group]
        shown += [group for group in by_group if group not in GROUPS]
        for group in shown:
            section = nodes.section(ids=[f"settings-{group}"], names=[f"settings-{group}"])
            section += nodes.title(text=group.capitalize())
            if group in GROUP_INTROS:
                section += self.parse_text_to_nodes(GROUP_INTROS[group])
            section += _table(by_group[group])
            sections.append(section)
        return sections


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("settings-catalog", SettingsCatalog)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
