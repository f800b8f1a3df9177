"""An async client for the encode server's HTTP contract, for prefill ranks and tests.

Answers come back as typed results; error answers as the same :mod:`trio_encode.errors`
classes the server raised, chosen by the body's machine-readable ``"error"`` kind (so
``except RequestReleased`` reads the same on both sides, and nothing parses the prose). Every
error has ``status``, ``kind`` and the server's ``message``; an :class:`EngineFailed` also has
the engine's ``engine_code``, and a 503 the server's ``Retry-After`` as ``retry_after``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from trio_encode.client.transport import KeepAliveTransport
from trio_encode.engine.base import EngineCall
from trio_encode.errors import EngineFailed, RequestError, error_class
from trio_encode.observer import METRIC_PREFIX

TransferFailed = EngineFailed
"""The name earlier versions of this client gave to :class:`EngineFailed`."""

_ENGINE_CALLS: tuple[EngineCall, ...] = ("initialize", "register", "deregister", "transfer")


class UnexpectedResponse(RequestError):
    """A status or body that the contract does not describe."""

    kind = "unexpected_response"


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

    One client holds one connection pool; share it between requests of a rank. Over plain
    ``http://`` it uses :class:`~trio_encode.client.transport.KeepAliveTransport` (a rank pays
    the client's CPU on every send); pass ``http`` to bring an ``httpx.AsyncClient`` of your
    own (TLS settings, proxies, event hooks).
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
        if http is None:
            plain = httpx.URL(base_url).scheme == "http"
            http = httpx.AsyncClient(
                base_url=base_url,
                timeout=timeout,
                transport=KeepAliveTransport() if plain else None,
            )
        self._http = http
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
    raise error_of(response.status_code, data, response.headers)


def error_of(
    status: int, data: dict[str, Any], headers: httpx.Headers | None = None
) -> RequestError:
    """The exception for an error answer, by its ``"error"`` kind; ``status`` is the one
    answered and ``retry_after`` the server's ``Retry-After``, when it sent one."""
    message = str(data.get("message"))
    req_id = data.get("req_id")
    req_id = req_id if isinstance(req_id, str) else None
    kind = data.get("error")
    cls = error_class(kind) if isinstance(kind, str) else None
    error: RequestError
    if cls is None:
        error = UnexpectedResponse(
            f"HTTP {status} with error kind {kind!r}, unknown to this client: {message}",
            req_id=req_id,
        )
    elif issubclass(cls, EngineFailed):
        code = data.get("engine_code")
        call = next((c for c in _ENGINE_CALLS if c == data.get("engine_call")), None)
        error = cls(
            message,
            req_id=req_id,
            engine_code=code if isinstance(code, int) else None,
            engine_call=call,
        )
    else:
        error = cls(message, req_id=req_id)
    error.status = status
    retry_after = headers.get("Retry-After") if headers is not None else None
    if retry_after is not None and retry_after.isdigit():
        error.retry_after = int(retry_after)
    return error


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` (with exactly these ``labels``) in Prometheus text; 0 when
    absent, as a counter that was never incremented is. ``name`` may leave out the prefix of
    the server's metrics (``"live_scopes"`` is ``"trio_encode_live_scopes"``)."""
    from prometheus_client.parser import text_string_to_metric_families

    if not name.startswith(METRIC_PREFIX):
        name = METRIC_PREFIX + name
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0
