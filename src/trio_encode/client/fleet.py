"""A client for a fleet of encode servers: content-affinity routing, health, failover.

Each request goes to the encoder that ranks first for its content
(:mod:`trio_encode.client.ranking`) among those believed up
(:mod:`trio_encode.client.health`). If that encoder refuses the connection, drops it, or
answers 503, it is marked down and the request runs again, ``/encode`` and ``/send`` both, on
the next encoder in the ranking, into a fresh landing slot (the first encoder's transfer may
still be writing into the old one, which stays quarantined). Every other error is the
request's own (bad input, an engine failure, an expired scope) and is raised: another encoder
would answer the same.

Siblings that disagree about which encoder is up split a request across two encoders. Each
rank still gets the right bytes (the encoders run the same model), but each encoder's scope
then sees fewer than ``receive_count`` receivers and is freed only by its backstop; the
servers count such scopes (``trio_encode_scopes_split_total``).

The encoder list is a fixed list of base URLs, or a file of them (one per line, ``#``
comments) that is re-read when it changes, so encoders can be added and removed without
restarting the ranks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import trio

from trio_encode.client.health import HealthTracker
from trio_encode.client.http import (
    EncodeClient,
    EncodeResult,
    SendResult,
    UnexpectedResponse,
)
from trio_encode.client.ranking import content_digest, rank, request_digest
from trio_encode.client.receiver import LandingPool, LandingSlot
from trio_encode.errors import Overloaded, RequestError, ShuttingDown

log = logging.getLogger(__name__)

RouteBy = Literal["content", "request"]
"""``content``: a request's images pick its encoder (siblings and repeated images meet).
``request``: its ``req_id`` does (siblings still meet, repeated images scatter: the baseline of
an encoder fleet without content affinity)."""


class NoEncoderAvailable(RequestError):
    """Every encoder in the list failed (refused, dropped the connection, or answered 503)."""

    status = 503


class EncoderList:
    """The encoders' base URLs: a fixed list, or a file re-read when its mtime changes.

    A file that cannot be read or lists no encoder keeps the last good list (logged), so a
    half-written update never leaves the ranks with nowhere to go.
    """

    def __init__(self, source: Sequence[str] | Path) -> None:
        self._path = source if isinstance(source, Path) else None
        self._urls: list[str] = [] if isinstance(source, Path) else _clean(source)
        self._mtime: float | None = None
        if self._path is None and not self._urls:
            raise ValueError("the encoder list is empty")
        if self._path is not None and not self.current():
            raise ValueError(f"{self._path} lists no encoder")

    def current(self) -> list[str]:
        """The list as it is now (a stat per call; the file is read only when it changed)."""
        if self._path is None:
            return self._urls
        try:
            mtime = self._path.stat().st_mtime_ns
            if mtime != self._mtime:
                urls = _clean(self._path.read_text().splitlines())
                if urls:
                    self._urls, self._mtime = urls, mtime
                else:
                    log.warning("%s lists no encoder; keeping the previous list", self._path)
        except OSError as exc:
            log.warning("cannot read %s (%s); keeping the previous list", self._path, exc)
        return self._urls


def _clean(lines: Sequence[str]) -> list[str]:
    urls = [line.split("#", 1)[0].strip().rstrip("/") for line in lines]
    return list(dict.fromkeys(url for url in urls if url))


@dataclass(frozen=True)
class FleetResult:
    """A request served by one encoder of the fleet."""

    encoder: str
    """The base URL of the encoder that served it."""
    encoded: EncodeResult
    sent: SendResult
    failovers: int
    """Encoders tried and given up on before this one."""
    slot: LandingSlot
    """Where the bytes landed (verified by the caller with ``encoded.checksum``); the caller
    releases it."""


@dataclass
class FleetStats:
    """What this client did, for logs and demos."""

    served: dict[str, int] = field(default_factory=dict)
    """Requests served, by encoder."""
    failovers: int = 0


class FleetClient:
    """Runs each rank's ``/encode`` + ``/send`` on the best encoder that is up.

    ``async with FleetClient.open(encoders) as fleet`` also probes down encoders in the
    background, bringing them back as soon as they answer ``/health``.
    """

    def __init__(
        self,
        encoders: Sequence[str] | Path | EncoderList,
        *,
        token: str | None = None,
        timeout: float | None = 300.0,
        health: HealthTracker | None = None,
        route_by: RouteBy = "content",
    ) -> None:
        self.encoders = encoders if isinstance(encoders, EncoderList) else EncoderList(encoders)
        self.health = health if health is not None else HealthTracker()
        self.stats = FleetStats()
        self.route_by = route_by
        self._token = token
        self._timeout = timeout
        self._clients: dict[str, EncodeClient] = {}

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        encoders: Sequence[str] | Path | EncoderList,
        *,
        probe_interval: float = 0.5,
        **kwargs: Any,
    ) -> AsyncIterator[FleetClient]:
        """A client whose down encoders are probed every ``probe_interval`` seconds."""
        fleet = cls(encoders, **kwargs)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fleet.probe_forever, probe_interval)
                yield fleet
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await fleet.aclose()

    async def __aenter__(self) -> FleetClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    def ranking(
        self, mm_items: Sequence[str], req_id: str = "", modality: str = "IMAGE"
    ) -> list[str]:
        """The encoders in the order a request (a part of ``modality``) tries them now."""
        if self.route_by == "content":
            key = content_digest(mm_items, modality)
        else:
            key = request_digest(req_id)
        return self.health.order(rank(self.encoders.current(), key))

    async def encode_and_send(
        self,
        req_id: str,
        mm_items: list[str],
        *,
        pool: LandingPool,
        receive_count: int | None = None,
        **echo: Any,
    ) -> FleetResult:
        """``/encode`` then ``/send`` into a slot of ``pool``, failing over along the ranking.

        The slot is allocated from the first successful ``/encode`` answer and returned in the
        result (release it when its bytes are used). A ``/send`` that did not answer 200 may
        still have a transfer in flight into its slot, from an encoder this client has given up
        on: that slot is quarantined (:meth:`LandingSlot.quarantine`) and the next encoder
        sends into a fresh one, so a late write of the first can never land where the second
        was answered 200. Raises :class:`NoEncoderAvailable` when every encoder failed, or the
        request's own error (:mod:`trio_encode.errors`,
        :class:`~trio_encode.client.TransferFailed`), or
        :class:`~trio_encode.client.PoolExhausted` when ``pool`` has no room (quarantined
        slots included); no slot is left allocated then.
        """
        order = self.ranking(mm_items, req_id, echo.get("modality", "IMAGE"))
        self.health.forget(order)
        slot: LandingSlot | None = None
        size: int | None = None
        tried: list[str] = []
        try:
            for encoder in order:
                client = self._client(encoder)
                try:
                    encoded = await client.encode(
                        req_id, mm_items, receive_count=receive_count, **echo
                    )
                    if size is None:
                        size = encoded.embedding_size
                    elif encoded.embedding_size > size:
                        raise UnexpectedResponse(
                            f"{encoder} answered {encoded.embedding_size} bytes where "
                            f"{tried[-1]} answered {size}: the fleet runs different models",
                            req_id=req_id,
                        )
                    if slot is None:
                        slot = pool.allocate(size)
                    try:
                        sent = await client.send(req_id, pool.session_id, slot.address)
                    except BaseException:
                        # Not answered 200: that encoder's transfer may still be writing here.
                        slot.quarantine()
                        slot = None
                        raise
                except (httpx.TransportError, Overloaded, ShuttingDown) as exc:
                    log.warning(
                        "encoder %s failed (%s: %s); failing over",
                        encoder,
                        type(exc).__name__,
                        exc,
                        extra={"req_id": req_id},
                    )
                    self.health.mark_down(encoder)
                    tried.append(encoder)
                    continue
                self.health.mark_up(encoder)
                self.stats.served[encoder] = self.stats.served.get(encoder, 0) + 1
                self.stats.failovers += len(tried)
                result = FleetResult(encoder, encoded, sent, failovers=len(tried), slot=slot)
                slot = None  # the caller's now
                return result
        finally:
            if slot is not None:
                slot.release()  # allocated, never named in a /send
        self.stats.failovers += len(tried)
        raise NoEncoderAvailable(
            f"all {len(tried)} encoders failed: {', '.join(tried)}", req_id=req_id
        )

    async def probe(self) -> None:
        """Ask every encoder marked down for ``/health``; mark those that answer 200 up."""
        for encoder in self.health.down():
            try:
                with trio.fail_after(1.0):
                    healthy = await self._client(encoder).health()
            except (httpx.TransportError, trio.TooSlowError):
                continue
            if healthy:
                log.info("encoder %s is back", encoder)
                self.health.mark_up(encoder)

    async def probe_forever(self, interval: float) -> None:
        while True:
            await self.probe()
            await trio.sleep(interval)

    def _client(self, encoder: str) -> EncodeClient:
        client = self._clients.get(encoder)
        if client is None:
            client = self._clients[encoder] = EncodeClient(
                encoder, token=self._token, timeout=self._timeout
            )
        return client
