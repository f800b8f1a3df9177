"""The command line's options, generated from settings fields, and the settings they build.

No option of ``trio-encode`` is declared by hand: each is made from a field declared with
:func:`~trio_encode.declare.setting` (its type, default, bounds and help), so a setting added to
a model is a flag at once, and ``--help`` lists it under its group. A server command's flags
are read with :func:`load_settings` (flags over ``TRIO_ENCODE_*`` variables over the
``--config`` file over the defaults, see :mod:`trio_encode.settings`); a tool's own flags
(the demo's, the bench's...) with :func:`build`. A refused value is a usage error naming the
flag, before anything starts.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource

from trio_encode.declare import GROUPS, sections

if TYPE_CHECKING:
    from pydantic import ValidationError
    from pydantic.fields import FieldInfo

    from trio_encode.settings import ServerSettings, Setting

F = TypeVar("F", bound=Callable[..., Any])

SERVE_GROUPS: tuple[str, ...] = GROUPS
"""Every group of the server's settings: what `serve` accepts."""
MODEL_GROUPS: tuple[str, ...] = ("engine", "model", "batching", "cache")
"""The groups a command that loads the model but serves no clients of its own accepts."""


class SettingOption(click.Option):
    """An option made from a setting; it remembers its ``--help`` group."""

    def __init__(self, entry: Setting) -> None:
        info = entry.info
        decls = [entry.name, entry.flag, *entry.aliases]
        if is_bool(info):
            decls = [entry.name, f"{entry.flag}/--no-{entry.flag[2:]}"]
        notes = [f"env: {entry.env}"] if entry.env else []
        default = shown_default(info)
        if default is not None:
            notes.append(f"default: {default}")
        help_text = entry.help
        if notes:
            help_text += f"  [{'; '.join(notes)}]"
        super().__init__(
            decls,
            default=None,
            is_flag=is_bool(info) or None,
            metavar=None if is_bool(info) else metavar(info),
            help=help_text,
        )
        self.group: str = entry.group


class Later:
    """A command's setting options, made when the command's parameters are first needed: the
    settings models import pydantic and their layers, which ``trio-encode --help``, ``--version``
    and every other command do not need."""

    def __init__(self, make: Callable[[], list[click.Parameter]]) -> None:
        self.make = make


class GroupedCommand(click.Command):
    """A command whose setting options are made on first use (:class:`Later`) and whose
    ``--help`` lists them under their groups."""

    _params: list[click.Parameter | Later]

    @property
    def params(self) -> list[click.Parameter]:
        if any(isinstance(param, Later) for param in self._params):
            self._params = [
                made
                for param in self._params
                for made in (param.make() if isinstance(param, Later) else [param])
            ]
        return typing.cast("list[click.Parameter]", self._params)

    @params.setter
    def params(self, params: list[click.Parameter]) -> None:
        self._params = [*params]  # with the Later entries the option decorators put in it

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        options: list[tuple[str, str]] = []
        grouped: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if isinstance(param, SettingOption):
                grouped.setdefault(param.group, []).append(record)
            else:
                options.append(record)
        for title, records in [("options", options), *((g, grouped[g]) for g in sections(grouped))]:
            if records:
                with formatter.section(title.capitalize()):
                    formatter.write_dl(records)


def is_bool(info: FieldInfo) -> bool:
    """Whether a setting is an on/off flag (``--x/--no-x``)."""
    return info.annotation is bool


def metavar(info: FieldInfo) -> str:
    """What ``--help`` shows a setting's value as: its choices, SIZE, INTEGER..."""
    from trio_encode.sizes import parse_size

    annotation = info.annotation
    choices = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else ()
    if choices:
        return "[" + "|".join(str(choice) for choice in choices) + "]"
    if any(getattr(meta, "func", None) is parse_size for meta in info.metadata):
        return "SIZE"
    members = {_bare(member) for member in typing.get_args(annotation)} or {annotation}
    for kind, name in ((int, "INTEGER"), (float, "FLOAT"), (Path, "PATH")):
        if kind in members:
            return name
    if typing.get_origin(annotation) is tuple:
        return "N,N,..."
    return "TEXT"


def _bare(annotation: Any) -> Any:
    """``Annotated[Path, ...]`` -> ``Path``."""
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0]
    return annotation


def shown_default(info: FieldInfo) -> str | None:
    """A setting's default as ``--help`` shows it (None: not shown)."""
    from trio_encode.sizes import format_size, parse_size

    value = info.get_default(call_default_factory=True)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if any(getattr(meta, "func", None) is parse_size for meta in info.metadata):
        return format_size(value)
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value)
    return str(value)


def setting_options(entries: Callable[[], Iterable[Setting]]) -> Callable[[F], F]:
    """Add an option for each setting ``entries()`` returns to a :class:`GroupedCommand` (in
    order, in their groups), made when the command's parameters are first needed."""

    def apply(command: F) -> F:
        params = getattr(command, "__click_params__", [])
        params.append(Later(lambda: [SettingOption(entry) for entry in entries()]))
        command.__click_params__ = params  # type: ignore[attr-defined]
        return command

    return apply


def server_options(*groups: str) -> Callable[[F], F]:
    """The options of the server settings in ``groups``, plus ``--config``."""

    def entries() -> list[Setting]:
        from trio_encode.settings import catalog

        return [entry for entry in catalog() if entry.group in groups or entry.name == "config"]

    return setting_options(entries)


def model_options(model: Callable[[], type[Any]]) -> Callable[[F], F]:
    """Flags (no variables) for the declared settings of a command's own model (the demo's,
    the bench's); its fields without a group (nested settings) are not options. ``model``
    returns the class, so that its module is imported only when the options are needed."""
    return setting_options(lambda: command_settings(model()))


def command_settings(model: type[Any]) -> list[Setting]:
    """A command's own settings (the demo's, the bench's...): flags, no variable, no config
    key; fields without a group (nested settings, fixed values) are not among them."""
    from trio_encode.settings import Setting, model_fields

    return [
        Setting(name, None, name, info, env=None)
        for name, info in model_fields(model).items()
        if isinstance(info.json_schema_extra, dict) and "group" in info.json_schema_extra
    ]


def given(options: dict[str, Any], names: Iterable[str] | None = None) -> dict[str, Any]:
    """The options the command line actually set (so variables, the config file and the
    defaults decide the rest), limited to ``names`` when given."""
    ctx = click.get_current_context()
    wanted = set(options) if names is None else set(names)
    return {
        name: value
        for name, value in options.items()
        if name in wanted and ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    }


def load_settings(flags: dict[str, Any], **overrides: Any) -> ServerSettings:
    """The server settings (flags over variables over the config file over defaults), with
    ``overrides`` on top; a value any of them got wrong is a usage error naming where it is
    set."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from trio_encode.settings import ServerSettings, describe_error

    try:
        return ServerSettings(**{**flags, **overrides})
    except ValidationError as error:
        named = _names_as_typed(flags)
        where = partial(_where_typed, named, describe_error)
        raise click.UsageError(_validation_message(error, where, named)) from error
    except SettingsError as error:
        raise click.UsageError(str(error)) from error


def _names_as_typed(flags: dict[str, Any]) -> dict[str, str]:
    """Each setting the user set on the command line or in a ``TRIO_ENCODE_*`` variable, by
    flat name: what they typed to set it (``--allowed-receivers``, or
    ``TRIO_ENCODE_ALLOWED_RECEIVERS``), so that an error names it as they know it."""
    import os

    from trio_encode.settings import catalog

    typed: dict[str, str] = {}
    for entry in catalog():
        if entry.name in flags:
            typed[entry.name] = entry.flag
        elif entry.env and os.environ.get(entry.env, "") != "":
            typed[entry.name] = entry.env
    return typed


def _where_typed(
    named: dict[str, str],
    describe: Callable[[tuple[int | str, ...]], str],
    loc: tuple[int | str, ...],
) -> str:
    """Where the value an error points at was set: the flag or variable the user typed,
    else every place it could be set (the config file, or a default another value broke)."""
    from trio_encode.settings import SECTIONS

    names = [str(part) for part in loc]
    flat = SECTIONS[names[0]][1] + names[1] if len(names) >= 2 and names[0] in SECTIONS else None
    flat = flat or (names[0] if names and names[0] not in SECTIONS else None)
    return named[flat] if flat in named else describe(loc)


def _in_typed_terms(message: str, named: dict[str, str]) -> str:
    """``message`` with each setting the user typed named as they typed it: its flag or its
    variable, where the message says ``allowed_receivers`` or ``--allowed-receivers``."""
    from trio_encode.settings import flag_of

    for name, typed in named.items():
        flag = flag_of(name)
        message = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", typed, message)
        message = re.sub(rf"(?<![\w./-]){re.escape(name)}(?![\w/-])", typed, message)
    return message


def build(model: Callable[..., Any], flags: dict[str, Any], **values: Any) -> Any:
    """A command's own model from its flags; a refused value is a usage error."""
    from pydantic import ValidationError

    try:
        return model(**values, **flags)
    except ValidationError as error:
        message = _validation_message(
            error, lambda loc: "--" + str(loc[0]).replace("_", "-") if loc else "settings"
        )
        raise click.UsageError(message) from error


def _validation_message(
    error: ValidationError,
    where: Callable[[tuple[int | str, ...]], str],
    named: dict[str, str] | None = None,
) -> str:
    lines = []
    for problem in error.errors():
        message = problem["msg"].removeprefix("Value error, ")
        if named:
            message = _in_typed_terms(message, named)
        lines.append(f"invalid {where(problem['loc'])}: {message}")
    return "\n".join(lines)
