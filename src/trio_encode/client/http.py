"""An async client for the encode server's HTTP contract, for prefill ranks and tests.

Answers come back as typed results; error answers as the same :mod:`trio_encode.errors`
classes the server raised (so ``except RequestReleased`` reads the same on both sides), plus
:class:`TransferFailed` for a 502 (carrying the engine's return code) and
:class:`RequestRejected` for 401/413. Every error has ``status`` and the server's ``message``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from trio_encode.errors import (
    EncodeFailed,
    InvalidInput,
    Overloaded,
    ReceiveCountConflict,
    RequestError,
    RequestReleased,
    ScopeExpired,
    ShuttingDown,
    UnknownRequest,
)

_ERRORS: dict[int, type[RequestError]] = {
    cls.status: cls
    for cls in (
        InvalidInput,
        UnknownRequest,
        ReceiveCountConflict,
        RequestReleased,
        EncodeFailed,
        ScopeExpired,
    )
}
_ENGINE_CODE = re.compile(r"failed with code (-?\d+)")


class TransferFailed(RequestError):
    """502: the server's transfer engine refused (``code`` is the engine's return code)."""

    status = 502

    def __init__(self, message: str, *, req_id: str | None = None, code: int | None) -> None:
        super().__init__(message, req_id=req_id)
        self.code = code


class RequestRejected(RequestError):
    """401 (bad or missing token) or 413 (body too large): the request was not looked at."""


class UnexpectedResponse(RequestError):
    """A status or body that the contract does not describe."""


@dataclass(frozen=True)
class EncodeResult:
    req_id: str
    embedding_len: int
    embedding_dim: int
    embedding_size: int
    dtype: str
    receive_count: int | None
    """``None`` while no call for the ``req_id`` has named it (the first ``/send`` will)."""
    checksum: str
    """``algorithm:hex`` of the embedding's bytes (:meth:`LandingSlot.verify` checks it)."""
    body: dict[str, Any]
    """The whole answer (with the echoed fields), to pass along as the contract intends."""


@dataclass(frozen=True)
class SendResult:
    req_id: str
    embedding_len: int
    embedding_dim: int
    embedding_size: int
    dtype: str
    receivers_done: int
    receive_count: int
    checksum: str
    repeat: bool
    """The receiver had already been served and this answer repeats it (no bytes moved)."""


class EncodeClient:
    """``async with EncodeClient(url) as client: await client.encode(...)``.

    One client holds one connection pool; share it between requests of a rank.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float | None = 300.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = http or httpx.AsyncClient(base_url=base_url, timeout=timeout)
        self._headers = headers

    async def __aenter__(self) -> EncodeClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def encode(
        self,
        req_id: str,
        mm_items: list[str],
        *,
        receive_count: int | None = None,
        modality: str = "IMAGE",
        **echo: Any,
    ) -> EncodeResult:
        """POST /encode; ``echo`` fields (``num_parts``, ``prefill_host``, ...) come back."""
        body: dict[str, Any] = {"req_id": req_id, "mm_items": mm_items, "modality": modality}
        if receive_count is not None:
            body["receive_count"] = receive_count
        answer = await self.post("/encode", {**echo, **body})
        return EncodeResult(
            req_id=answer["req_id"],
            embedding_len=answer["embedding_len"],
            embedding_dim=answer["embedding_dim"],
            embedding_size=answer["embedding_size"],
            dtype=answer["dtype"],
            receive_count=answer["receive_count"],
            checksum=answer["checksum"],
            body=answer,
        )

    async def send(
        self,
        req_id: str,
        session_id: str,
        buffer_address: int,
        *,
        receive_count: int | None = None,
    ) -> SendResult:
        """POST /send; returns once the embedding is in ``buffer_address``."""
        body: dict[str, Any] = {
            "req_id": req_id,
            "session_id": session_id,
            "buffer_address": buffer_address,
        }
        if receive_count is not None:
            body["receive_count"] = receive_count
        answer = await self.post("/send", body)
        return SendResult(
            **{key: answer[key] for key in SendResult.__dataclass_fields__},
        )

    async def health(self) -> bool:
        """Whether the server says it is ready."""
        response = await self._http.get("/health")
        return response.status_code == 200

    async def metrics(self) -> str:
        """The server's Prometheus text."""
        response = await self._http.get("/metrics")
        response.raise_for_status()
        return response.text

    async def post(self, path: str, body: Any) -> dict[str, Any]:
        """POST a JSON body; the answer's JSON, or the error it stands for raised."""
        response = await self._http.post(path, json=body, headers=self._headers)
        return answer_of(response)


def answer_of(response: httpx.Response) -> dict[str, Any]:
    """The JSON of a 200, or the typed error of anything else."""
    try:
        data = response.json()
    except ValueError:
        data = None
    if response.status_code == 200 and isinstance(data, dict):
        return data
    if not isinstance(data, dict) or data.get("status") != "error":
        raise UnexpectedResponse(
            f"HTTP {response.status_code} with a body outside the contract: {response.text[:200]!r}"
        )
    raise error_of(response.status_code, str(data.get("message")), data.get("req_id"))


def error_of(status: int, message: str, req_id: str | None) -> RequestError:
    """The exception for an error answer; ``status`` is set on it."""
    error: RequestError
    if status == 502:
        match = _ENGINE_CODE.search(message)
        error = TransferFailed(message, req_id=req_id, code=int(match[1]) if match else None)
    elif status in (401, 413):
        error = RequestRejected(message, req_id=req_id)
    elif status == 503:
        cls = ShuttingDown if "shutting down" in message or "stop" in message else Overloaded
        error = cls(message, req_id=req_id)
    else:
        error = _ERRORS.get(status, UnexpectedResponse)(message, req_id=req_id)
    error.status = status  # the status actually answered (401 and 413 share a class)
    return error


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` (with exactly these ``labels``) in Prometheus text; 0 when
    absent, as a counter that was never incremented is."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0
