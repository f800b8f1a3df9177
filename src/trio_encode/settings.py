"""Every setting of a running server in one frozen value, and where its values come from.

Each setting is declared once, as a field of the settings model of the layer that obeys it:
:class:`~trio_encode.service.ServiceSettings` (the scopes),
:class:`~trio_encode.engine.mooncake.MooncakeSettings` (the transfer engine),
:class:`~trio_encode.encoder.EncoderSettings` (the model, batching, cache, input limits) and
:class:`ServerSettings` itself (HTTP and logging). :class:`ServerSettings` nests the other
three and reads every field, under one flat name, from four places; the first that has it wins:

1. a command-line flag (``--engine-protocol``), passed as a keyword argument;
2. an environment variable (``TRIO_ENCODE_ENGINE_PROTOCOL``);
3. the TOML file named by ``config`` (``engine_protocol = "rdma"``);
4. the field's default.

The flat name of a field is its own name, except in the engine's model, whose fields are
prefixed ``engine_``. Values are checked once, by the models, whichever place they came from.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, cast

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from trio_encode.declare import SETTINGS, comma_separated, in_group, secret_in_file
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.engine.mooncake import MooncakeSettings, default_progress_timeout
from trio_encode.receivers import ReceiverPolicy
from trio_encode.service import ServiceSettings
from trio_encode.sizes import ByteSize, KiB, MiB

ENV_PREFIX = "TRIO_ENCODE_"

LogFormat = Literal["kv", "json"]
LogLevel = Annotated[
    Literal["DEBUG", "INFO", "WARNING", "ERROR"],
    BeforeValidator(lambda value: value.upper() if isinstance(value, str) else value),
]


def _not_empty(token: str | None) -> str | None:
    if token == "":
        raise ValueError("must not be empty (leave it unset to disable auth)")
    return token


def _receiver_entries(entries: tuple[str, ...]) -> tuple[str, ...]:
    ReceiverPolicy.build(entries)  # raises ValueError naming a malformed network
    return entries


ReceiverEntries = Annotated[
    tuple[str, ...], BeforeValidator(comma_separated), AfterValidator(_receiver_entries)
]

SECTIONS: dict[str, tuple[type[Any], str]] = {
    "service": (ServiceSettings, ""),
    "engine": (MooncakeSettings, "engine_"),
    "encoder": (EncoderSettings, ""),
}
"""The nested settings models: the field of :class:`ServerSettings` that holds each, its model,
and the prefix of its fields' flat names."""


server_setting = in_group("server")
logging_setting = in_group("logging")


class ServerSettings(BaseSettings):
    """How the HTTP server, the request scopes, the transfer engine and the encoder are set up.

    Built with keyword arguments (flat names, or whole ``service``/``engine``/``encoder``
    values), it also reads ``TRIO_ENCODE_*`` variables and the ``config`` file for what the
    arguments leave out.
    """

    model_config = cast(SettingsConfigDict, {**SETTINGS, "frozen": True})

    config: Path | None = server_setting(None)
    """A TOML file of settings, keyed by the flags' names with underscores (e.g. port = 9000,
    engine_protocol = "rdma", cache_bytes = "1GiB"); flags and TRIO_ENCODE_* variables override
    it."""
    host: str = server_setting("127.0.0.1")
    """Address to listen on."""
    port: int = server_setting(8000, ge=0, le=65535)
    """Port to listen on; 0 picks a free one and logs it."""
    max_body_bytes: ByteSize = server_setting(64 * MiB, gt=0)
    """Larger request bodies are refused with 413."""
    max_bodies_in_flight_bytes: ByteSize = server_setting(256 * MiB, gt=0)
    """Request bytes held at once, all connections together; one client address holds at most
    half of it. A body that would pass either gets 503 (Retry-After) before more of it is read,
    so slow or many uploads cannot take the memory other requests need."""
    max_control_body_bytes: ByteSize = server_setting(64 * KiB, gt=0)
    """Bodies of every route but /encode (/send, pulls: a few hundred bytes); larger ones are
    refused with 413 as they arrive."""
    max_sends_per_client: int = server_setting(256, gt=0)
    """/send calls one client address may have in flight; more get 503. At most half of
    engine_transfers_in_flight, so one client cannot hold every transfer slot."""
    allowed_receivers: ReceiverEntries = server_setting(())
    """Hosts /send may write to, besides loopback (always allowed): CIDR networks, addresses or host
    names (matched as written, not resolved), comma-separated; '*' allows any host (logged as a
    warning at start). A receiver elsewhere gets 403."""
    token: Annotated[str | None, AfterValidator(_not_empty)] = server_setting(
        None, flags=("--api-key",), repr=False
    )
    """Require 'Authorization: Bearer TOKEN' on /encode, /send and pulls (/health and /metrics stay
    open). On a command line it shows in `ps`: prefer TRIO_ENCODE_TOKEN or token_file."""
    token_file: Path | None = server_setting(None)
    """Read the token from this file (its first line), so it appears neither on the command line nor
    in the environment; not with token."""
    log_level: LogLevel = logging_setting("INFO")
    """Least severe log lines shown."""
    log_format: LogFormat = logging_setting("kv")
    """key=value lines for people, JSON lines for log shippers."""
    access_log: bool = logging_setting(True)
    """Log one line per HTTP request (method, path, status, duration, bytes, req_id)."""
    malloc_arenas: int | None = server_setting(2, ge=1)
    """glibc malloc arenas for the server process (none: glibc's default, 8 per core, under which
    RSS climbs far above the memory actually held)."""
    heap_trim_seconds: float = server_setting(1.0, ge=0)
    """How often the free pages inside malloc's heaps go back to the system (0: never)."""
    service: ServiceSettings = Field(default_factory=ServiceSettings)
    engine: MooncakeSettings = Field(default_factory=MooncakeSettings)
    encoder: EncoderSettings = Field(default_factory=EncoderSettings)

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        return nest(data) if isinstance(data, Mapping) else data

    @property
    def receiver_policy(self) -> ReceiverPolicy:
        """Where /send may write (see :mod:`trio_encode.receivers`)."""
        return ReceiverPolicy.build(self.allowed_receivers)

    @model_validator(mode="after")
    def _token_from_file(self) -> ServerSettings:
        if self.token_file is None:
            return self
        if self.token is not None:
            raise ValueError("give token or token_file, not both")
        token = secret_in_file(self.token_file, "token_file")
        object.__setattr__(self, "token", token)  # frozen: set once, here
        return self

    @model_validator(mode="after")
    def _progress_timeout(self) -> ServerSettings:
        """The engine's progress timeout must end a stalled transfer before the request's
        deadline; unset, it is derived from ``send_timeout``."""
        send_timeout = self.service.send_timeout
        given = self.engine.progress_timeout
        if given is None:
            derived = replace(self.engine, progress_timeout=default_progress_timeout(send_timeout))
            # Frozen, and an after-validator must return ``self``: filled in once, here.
            object.__setattr__(self, "engine", derived)
            return self
        if given >= send_timeout:
            raise ValueError(
                f"--engine-progress-timeout ({given} s) must be below --send-timeout "
                f"({send_timeout:g} s): a stalled transfer must fail before its request's "
                "deadline"
            )
        return self

    @model_validator(mode="after")
    def _client_share(self) -> ServerSettings:
        """One client's /send calls (each one transfer) hold at most half the engine's
        transfers in flight, whatever receivers they name: the rest stays for others."""
        cap = self.engine.transfers_in_flight
        if 2 * self.max_sends_per_client > cap:
            raise ValueError(
                f"--max-sends-per-client ({self.max_sends_per_client}) must be at most half of "
                f"--engine-transfers-in-flight ({cap}): one client must leave the rest of the "
                "transfer capacity to others"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, then ``TRIO_ENCODE_*`` variables, then the config file: each read by
        flat name and nested here, so a whole section passed as an argument wins over a
        variable naming one of its fields."""
        arguments = getattr(init_settings, "init_kwargs", {})
        given = _Layer(settings_cls, lambda _: arguments)
        if not _read_outside.get():
            return (given,)
        return (
            given,
            _Layer(settings_cls, lambda _: _from_environ(os.environ)),
            _Layer(settings_cls, _from_config_file),
        )

    @classmethod
    def exactly(cls, **values: Any) -> ServerSettings:
        """These values over the defaults, reading no variable and no config file: for an
        in-process server whose own clients must agree with it (the bench's, a test's), which
        a ``TRIO_ENCODE_TOKEN`` in the environment would otherwise lock them out of."""
        reset = _read_outside.set(False)
        try:
            return cls(**values)
        finally:
            _read_outside.reset(reset)


_read_outside: ContextVar[bool] = ContextVar("read_outside", default=True)
"""Whether :class:`ServerSettings` reads variables and the config file (see ``exactly``)."""


@dataclass(frozen=True)
class Setting:
    """One setting as the outside sees it: its flat name, flag, variable and declaration."""

    name: str
    """The flat name: a keyword of :class:`ServerSettings` and a key of the config file."""
    section: str | None
    """The field of :class:`ServerSettings` whose model declares it (None: declared there)."""
    field: str
    """Its name in the declaring model."""
    info: FieldInfo
    env: str | None
    """Its ``TRIO_ENCODE_*`` variable; None for a command's own flags (the demo's, the
    bench's), which only the command line sets."""

    @property
    def flag(self) -> str:
        return flag_of(self.name)

    @property
    def group(self) -> str:
        """The ``--help`` section it is listed in."""
        return cast(str, _extra(self.info)["group"])

    @property
    def help(self) -> str:
        """Its field's docstring on one line (as ``--help`` and the docs show it)."""
        if not self.info.description:
            raise TypeError(f"setting {self.name!r} has no docstring: it is its help")
        return " ".join(self.info.description.split())

    @property
    def aliases(self) -> tuple[str, ...]:
        """Other flags it answers to."""
        return tuple(_extra(self.info).get("flags", ()))


def flag_of(name: str) -> str:
    """The command-line flag of a setting's flat name: ``send_timeout`` -> ``--send-timeout``."""
    return "--" + name.replace("_", "-")


def _extra(info: FieldInfo) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def model_fields(model: type[Any]) -> dict[str, FieldInfo]:
    """The declared fields of a pydantic model or pydantic dataclass."""
    return cast(dict[str, FieldInfo], model.__pydantic_fields__)


@cache
def catalog() -> tuple[Setting, ...]:
    """Every setting of :class:`ServerSettings`, sections flattened, in declaration order."""
    found: list[Setting] = []
    for name, info in ServerSettings.model_fields.items():
        if name in SECTIONS:
            model, prefix = SECTIONS[name]
            for field, inner in model_fields(model).items():
                flat = prefix + field
                found.append(Setting(flat, name, field, inner, ENV_PREFIX + flat.upper()))
        else:
            found.append(Setting(name, None, name, info, ENV_PREFIX + name.upper()))
    for entry in found:
        if "group" not in _extra(entry.info):
            raise TypeError(f"setting {entry.name!r} is not declared with declare.setting()")
    return tuple(found)


@cache
def _by_name() -> dict[str, Setting]:
    return {entry.name: entry for entry in catalog()}


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Flat names to :class:`ServerSettings`' shape: ``{"engine_protocol": "rdma"}`` becomes
    ``{"engine": {"protocol": "rdma"}}``. A section given whole keeps its own values for the
    fields no flat name overrides; unknown names are left for validation to refuse."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        if key in SECTIONS:
            given = asdict(value) if isinstance(value, SECTIONS[key][0]) else value
            nested[key] = {**nested.get(key, {}), **given} if isinstance(given, dict) else given
    for key, value in flat.items():
        entry = _by_name().get(key)
        if key in SECTIONS:
            continue
        if entry is None or entry.section is None:
            nested[key] = value
        else:
            section = nested.setdefault(entry.section, {})
            if isinstance(section, dict):
                section[entry.field] = value
    return nested


def _from_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``TRIO_ENCODE_<NAME>`` for every setting that has one; empty values count as unset."""
    found = {}
    for entry in catalog():
        value = environ.get(entry.env or "", "")
        if value != "":
            found[entry.name] = value
    return found


def _from_config_file(state: Mapping[str, Any]) -> dict[str, Any]:
    """The TOML file named by ``config`` in an argument or a variable (the file itself cannot
    name another)."""
    path = state.get("config")
    if path is None:
        return {}
    try:
        with Path(path).open("rb") as file:
            data = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise SettingsError(f"config file {path}: {error}") from error
    if "config" in data:
        raise SettingsError(f"config file {path}: a config file cannot name another")
    return config_keys(data, where=f"config file {path}")


def config_keys(data: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """A config file's keys as flat names: a key may be a setting's flat name or any of its
    flags' long names with underscores (``api_key`` for ``token``); an unknown key is an error
    that names the closest known ones."""
    known = {entry.name: entry.name for entry in catalog()}
    for entry in catalog():
        for flag in entry.aliases:
            known[flag.removeprefix("--").replace("-", "_")] = entry.name
    found: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in data.items():
        if key in SECTIONS:
            found[key] = value
            continue
        name = known.get(key)
        if name is None:
            close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise SettingsError(f"{where}: unknown setting {key!r}{hint}")
        if name in given_as:
            raise SettingsError(f"{where}: {given_as[name]!r} and {key!r} both set {name!r}")
        given_as[name] = key
        found[name] = value
    return found


class _Layer(PydanticBaseSettingsSource):
    """One source of flat values, handed to pydantic-settings nested; ``read`` gets what the
    sources before it found (the config file's path comes from there)."""

    def __init__(
        self,
        settings_cls: type[BaseSettings],
        read: Callable[[Mapping[str, Any]], Mapping[str, Any]],
    ) -> None:
        super().__init__(settings_cls)
        self._read = read

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # the values come whole from __call__

    def __call__(self) -> dict[str, Any]:
        return nest(self._read(self.current_state))


def describe_error(loc: tuple[int | str, ...]) -> str:
    """Where a setting a validation error points at is set: ``--port / TRIO_ENCODE_PORT``."""
    names = [str(part) for part in loc]
    if names and names[0] in SECTIONS and len(names) == 1:
        return f"{names[0]} settings"
    if names and names[0] in SECTIONS:
        name = SECTIONS[names[0]][1] + names[1]
    elif names:
        name = names[0]
    else:
        return "settings"
    entry = _by_name().get(name)
    if entry is None:
        return repr(name)
    return f"{entry.flag} / {entry.env} / {entry.name!r} in the config file"


def flat_values(settings: ServerSettings) -> dict[str, Any]:
    """Every setting's value by flat name (the shape of the config file)."""
    values = {}
    for entry in catalog():
        holder = settings if entry.section is None else getattr(settings, entry.section)
        values[entry.name] = getattr(holder, entry.field)
    return values


def flags(values: Mapping[str, Any]) -> list[str]:
    """Command-line flags that set ``values`` (flat names): ``{"port": 0, "warmup": False}``
    -> ``["--port", "0", "--no-warmup"]``; a list is comma-separated."""
    found: list[str] = []
    for name, value in values.items():
        flag = flag_of(name)
        if isinstance(value, bool):
            found.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            raise ValueError(f"{flag}: no flag gives the value None")
        elif isinstance(value, tuple):
            found += [flag, ",".join(str(item) for item in value)]
        else:
            found += [flag, str(value)]
    return found


def serve_flags(settings: ServerSettings) -> list[str]:
    """The ``trio-encode serve`` flags that give a child process exactly ``settings``: one for
    every setting that differs from its default. Start the child with
    :func:`child_environment`, so no ``TRIO_ENCODE_*`` variable adds to them."""
    defaults = flat_values(ServerSettings.exactly())
    return flags(
        {name: value for name, value in flat_values(settings).items() if value != defaults[name]}
    )


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its ``TRIO_ENCODE_*`` variables, and ``extra``: a
    child ``trio-encode serve`` then has only the settings its flags give it."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    return {**inherited, **(extra or {})}


def server_settings(**values: Any) -> ServerSettings:
    """:meth:`ServerSettings.exactly`, a refused value a :class:`ValueError` naming its flag:
    for a tool that starts servers, which checks their settings before it starts anything."""
    try:
        return ServerSettings.exactly(**values)
    except ValidationError as error:
        problems = [
            f"{_flag_at(problem['loc'])}: {problem['msg'].removeprefix('Value error, ')}"
            for problem in error.errors()
        ]
        raise ValueError("; ".join(problems)) from None


def _flag_at(loc: tuple[int | str, ...]) -> str:
    names = [str(part) for part in loc]
    if len(names) >= 2 and names[0] in SECTIONS:
        return flag_of(SECTIONS[names[0]][1] + names[1])
    return flag_of(names[0]) if names else "settings"
