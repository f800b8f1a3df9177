"""The request bodies of the HTTP contract, checked by pydantic, and the answers built from
service results.

Two dialects share these models: ours, and SGLang's EPD Mooncake path (0.5.23), whose tokenizer
sends items as URL strings or ``{"url": ...}`` objects with per-item options, ``num_parts`` and
``part_idx``, and no ``receive_count``. Unknown fields are ignored (prefill ranks echo a whole
``/encode`` or pull answer back into ``/send``). Integers are strict: ``"5"`` or ``true`` where a
count or an address belongs is a client bug worth a 400, not something to guess at.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from trio_encode.completion import Endpoint
from trio_encode.errors import InvalidInput, clip
from trio_encode.request_types import EmbeddingShape, SendReport, grid_dim
from trio_encode.service import EncodeReport

_SESSION_ID = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$")

ReqId = Annotated[StrictStr, Field(min_length=1, max_length=256)]
MAX_RECEIVE_COUNT = 1024
"""The most receivers one request may name: far above any tensor-parallel size, low enough that
a request cannot keep its scope (and its memory) waiting for receivers that cannot exist."""
Count = Annotated[StrictInt, Field(ge=1, le=MAX_RECEIVE_COUNT)]
MAX_PARTS = 1024
"""The most parts one request may be split into (SGLang splits a request's items across its
encode servers: one part per server, at most one per item). Bounded like ``receive_count``:
the number reaches completion messages (a ZMQ frame packs it in 64 bits) and failure
handling, so an unbounded one could end a task or cost time in proportion to a number the
client made up."""
PartCount = Annotated[StrictInt, Field(ge=1, le=MAX_PARTS)]
PartIndex = Annotated[StrictInt, Field(ge=0, lt=MAX_PARTS)]

MAX_JSON_VALUES = 4096
"""At most this many JSON objects, arrays and ``,``-separated values in one body. A request's
real content is a few dozen values (up to ``queue_size`` items, each a string or a small
object); the cap is checked on the raw bytes before parsing, so a body of millions of tiny
values (``[{},{},...]`` in a field nobody reads) is refused before it is turned into
millions of Python objects."""
MAX_HASHES = 1024
"""Entries of SGLang's ``hashes`` (one per item in practice); each a number or a short string."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


MODALITIES = {"IMAGE": "IMAGE", "MULTI_IMAGES": "IMAGE", "VIDEO": "VIDEO", "AUDIO": "AUDIO"}
"""SGLang's modality names served (matched case-insensitively), and what each item is: a
``VIDEO`` or ``AUDIO`` part needs a model with that path (the encoder says so otherwise)."""


class MediaItem(_Body):
    """An item as an object: its ``url`` and per-item options. The options (``detail``,
    ``content_hash``, processor sizes) are ignored: this server's model fixes preprocessing."""

    url: StrictStr


class EncodeRequest(_Body):
    req_id: ReqId
    mm_items: Annotated[list[StrictStr | MediaItem], Field(min_length=1)]
    modality: StrictStr = "IMAGE"
    receive_count: Count | None = None
    num_parts: PartCount | None = None
    part_idx: PartIndex | None = None
    prefill_host: StrictStr | None = None
    embedding_port: StrictInt | list[StrictInt] | None = None
    hashes: (
        Annotated[
            list[StrictInt | Annotated[StrictStr, Field(max_length=256)]],
            Field(max_length=MAX_HASHES),
        ]
        | Annotated[StrictStr, Field(max_length=256)]
        | StrictInt
        | None
    ) = None
    """Accepted and ignored: the cache keys by the bytes actually received, never by a hash
    a client could get wrong (a wrong one would hand one request another's embedding)."""
    time_stats_json: Any = None
    """Accepted and ignored (SGLang's tracing)."""

    @field_validator("modality")
    @classmethod
    def _served(cls, value: str) -> str:
        if value.upper() not in MODALITIES:
            supported = ", ".join(MODALITIES)
            raise ValueError(
                f"modality {clip(value)} is not supported: this server encodes {supported}"
            )
        return value.upper()

    @property
    def items_are(self) -> str:
        """What the items are: ``IMAGE``, ``VIDEO`` or ``AUDIO``."""
        return MODALITIES[self.modality]

    @model_validator(mode="after")
    def _part_in_range(self) -> EncodeRequest:
        parts, index = self.num_parts, self.part_idx
        if parts is not None and index is not None and index >= parts:
            raise ValueError(
                f"part_idx {index} is out of range for num_parts {parts} "
                "(0 <= part_idx < num_parts)"
            )
        return self

    @model_validator(mode="after")
    def _endpoints_valid(self) -> EncodeRequest:
        self.endpoints  # noqa: B018 - raises ValueError for a bad host or port
        return self

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """The prefill ranks' ZMQ endpoints this body names (told if the encode fails)."""
        if self.prefill_host is None or self.embedding_port is None:
            return ()
        ports = self.embedding_port
        ports = ports if isinstance(ports, list) else [ports]
        return tuple(Endpoint(self.prefill_host, port) for port in dict.fromkeys(ports))

    @property
    def urls(self) -> list[str]:
        """The items as the strings the encoder loads."""
        return [item if isinstance(item, str) else item.url for item in self.mm_items]


class PullRequest(_Body):
    """SGLang's ``/scheduler_receive_meta_data``: wait for a part's sizes."""

    req_id: ReqId
    part_idx: PartIndex | None = None
    receive_count: Count | None = None


class SendRequest(_Body):
    req_id: ReqId
    session_id: StrictStr
    buffer_address: Annotated[StrictInt, Field(gt=0, lt=1 << 64)]
    receive_count: Count | None = None
    prefill_host: StrictStr | None = None
    embedding_port: StrictInt | list[StrictInt] | None = None
    """An int names the rank's ZMQ endpoint (with ``prefill_host``): SGLang's completion
    message goes there once the bytes landed. A list (an echoed ``/encode`` answer) names
    no single rank and is ignored."""
    part_idx: PartIndex | None = None

    @model_validator(mode="after")
    def _endpoint_valid(self) -> SendRequest:
        self.endpoint  # noqa: B018 - raises ValueError for a bad host or port
        return self

    @property
    def endpoint(self) -> Endpoint | None:
        """The rank's ZMQ endpoint, if the body names one."""
        if self.prefill_host is None or not isinstance(self.embedding_port, int):
            return None
        return Endpoint(self.prefill_host, self.embedding_port)

    @field_validator("session_id")
    @classmethod
    def _host_port(cls, value: str) -> str:
        match = _SESSION_ID.match(value)
        if match is None or not 0 < int(match.group(1)) <= 65535:
            raise ValueError(f"session_id must be 'host:port', got {clip(value)}")
        return value


Body = TypeVar("Body", bound=_Body)


def parse_body(model: type[Body], raw: bytes) -> Body:
    """The validated body, or :class:`InvalidInput` naming every problem (and the ``req_id``
    when the body got far enough to have one)."""
    # Counted on the raw bytes (C speed, no objects made): base64 and URLs hold no '{', '['
    # or ',' beyond a data URI's one comma, so honest bodies stay far below the cap.
    values = raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    if values > MAX_JSON_VALUES:
        raise InvalidInput(
            f"the body holds about {values} JSON values; at most {MAX_JSON_VALUES} are accepted"
        )
    try:
        data: Any = json.loads(raw)
    except RecursionError:
        raise InvalidInput("the body's JSON is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidInput(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidInput("the body must be a JSON object")
    req_id = data.get("req_id")
    # Echo the req_id only when it is itself valid: an id that is not cannot name a request.
    valid_id = req_id if isinstance(req_id, str) and 1 <= len(req_id) <= 256 else None
    try:
        return model.model_validate(data)
    except RecursionError:
        raise InvalidInput("the body's JSON is nested too deeply", req_id=valid_id) from None
    except ValidationError as exc:
        raise InvalidInput(_describe(exc), req_id=valid_id) from None


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in error["loc"]) or "body"
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}")
    return "invalid request: " + "; ".join(problems)


def _shape_fields(shape: EmbeddingShape) -> dict[str, Any]:
    return {
        "embedding_len": shape.rows,
        "embedding_lens": list(shape.image_lens),
        "embedding_dim": shape.dim,
        "embedding_size": shape.nbytes,
        "dtype": shape.dtype,
        "checksum": shape.checksum,
        "grid_dim": grid_dim(shape.grids),
        **dict(shape.media.meta),  # a video part's: what SGLang's prefill reads beside it
    }


def encode_answer(body: EncodeRequest, report: EncodeReport) -> dict[str, Any]:
    """The request's fields except ``mm_items`` and the ignored ones (the optional ones only
    when given), the scope's ``receive_count`` (``null`` until named), and the shape."""
    echoed = body.model_dump(exclude={"mm_items", "hashes", "time_stats_json"}, exclude_unset=True)
    echoed["modality"] = body.modality
    echoed["receive_count"] = report.receive_count
    return echoed | _shape_fields(report.shape)


def pull_answer(body: PullRequest, report: EncodeReport) -> dict[str, Any]:
    """SGLang's fields (``req_id``, ``part_idx``, ``embedding_size``, ``embedding_len``,
    ``embedding_dim``) and the dtype; a rank adds its buffer to this and sends it back.

    No checksum: a pull names only a ``req_id``, and a digest of the embedding would let
    whoever guesses an id confirm which image another client sent. The checksum comes with the
    answers of ``/encode`` (which names the images) and ``/send`` (which receives the bytes)."""
    fields = _shape_fields(report.shape)
    del fields["checksum"]
    return {"req_id": body.req_id, "part_idx": body.part_idx} | fields


def send_answer(req_id: str, report: SendReport) -> dict[str, Any]:
    return {
        "status": "ok",
        "req_id": req_id,
        **_shape_fields(report.shape),
        "receivers_done": report.receivers_done,
        "receive_count": report.receive_count,
        "repeat": report.repeat,
    }
