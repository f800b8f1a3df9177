"""The request bodies of the HTTP contract, checked by pydantic, and the answers built from
service results.

Unknown fields are ignored (prefill ranks echo a whole ``/encode`` answer back into ``/send``).
Integers are strict: ``"5"`` or ``true`` where a count or an address belongs is a client bug
worth a 400, not something to guess at.
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
)

from trio_encode.errors import InvalidInput
from trio_encode.request_types import EmbeddingShape, SendReport
from trio_encode.service import EncodeReport

_SESSION_ID = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$")

ReqId = Annotated[StrictStr, Field(min_length=1, max_length=256)]
Count = Annotated[StrictInt, Field(ge=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class EncodeRequest(_Body):
    req_id: ReqId
    mm_items: Annotated[list[StrictStr], Field(min_length=1)]
    modality: StrictStr = "IMAGE"
    receive_count: Count | None = None
    num_parts: StrictInt | None = None
    part_idx: StrictInt | None = None
    prefill_host: StrictStr | None = None
    embedding_port: StrictInt | None = None

    @field_validator("modality")
    @classmethod
    def _only_images(cls, value: str) -> str:
        if value.upper() != "IMAGE":
            raise ValueError(f"modality {value!r} is not supported: only IMAGE is")
        return "IMAGE"


class SendRequest(_Body):
    req_id: ReqId
    session_id: StrictStr
    buffer_address: Annotated[StrictInt, Field(gt=0, lt=1 << 64)]
    receive_count: Count | None = None

    @field_validator("session_id")
    @classmethod
    def _host_port(cls, value: str) -> str:
        match = _SESSION_ID.match(value)
        if match is None or not 0 < int(match.group(1)) <= 65535:
            raise ValueError(f"session_id must be 'host:port', got {value!r}")
        return value


Body = TypeVar("Body", bound=_Body)


def parse_body(model: type[Body], raw: bytes) -> Body:
    """The validated body, or :class:`InvalidInput` naming every problem (and the ``req_id``
    when the body got far enough to have one)."""
    try:
        data: Any = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidInput(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidInput("the body must be a JSON object")
    req_id = data.get("req_id")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # Echo the req_id only when it is itself valid: an id that is not cannot name a request.
        valid_id = isinstance(req_id, str) and 1 <= len(req_id) <= 256
        raise InvalidInput(_describe(exc), req_id=req_id if valid_id else None) from None


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
        "embedding_dim": shape.dim,
        "embedding_size": shape.nbytes,
        "dtype": shape.dtype,
        "checksum": shape.checksum,
    }


def encode_answer(body: EncodeRequest, report: EncodeReport) -> dict[str, Any]:
    """The request's fields except ``mm_items`` (the optional ones only when given), the
    scope's ``receive_count``, and the embedding's shape."""
    echoed = body.model_dump(exclude={"mm_items"}, exclude_unset=True)
    echoed["modality"] = body.modality
    echoed["receive_count"] = report.receive_count
    return echoed | _shape_fields(report.shape)


def send_answer(req_id: str, report: SendReport) -> dict[str, Any]:
    return {
        "status": "ok",
        "req_id": req_id,
        **_shape_fields(report.shape),
        "receivers_done": report.receivers_done,
        "receive_count": report.receive_count,
        "repeat": report.repeat,
    }
