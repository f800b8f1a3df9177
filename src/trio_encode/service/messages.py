"""What a request tells its prefill ranks: SGLang's completion message when a rank's bytes
have landed, and the request's failure to the ranks bound to it.

SGLang's rank fails a request at once on a non-200 ``/send``, while a 200 without its message
leaves it waiting for its own timeout: so a rank's message goes before its 200. Failures go in
the background, bounded per client (:class:`~trio_encode.completion.FailureNotices`), and only
to endpoints the request bound: a server must never push to addresses a client merely named.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from trio_encode.completion import (
    CompletionMessage,
    CompletionPusher,
    Endpoint,
    FailureNotices,
    Pusher,
)
from trio_encode.errors import CompletionFailed
from trio_encode.observer import LifecycleObserver, TaskFaults
from trio_encode.request_state import Failure
from trio_encode.request_types import SendReport, grid_dim
from trio_encode.service.parts import Notify, Part
from trio_encode.service.requests import RequestRecord

log = logging.getLogger(__name__)


class RankMessages:
    """Completion messages and failure notices; ``enabled`` false when turned off."""

    def __init__(
        self,
        *,
        timeout: float,
        observer: LifecycleObserver,
        faults: TaskFaults,
        closed: Callable[[], bool],
        pusher: Pusher | None = None,
    ) -> None:
        self.completions: Pusher = pusher or CompletionPusher(timeout=timeout, observer=observer)
        """Pushes SGLang's completion messages."""
        self.notices = FailureNotices(self.completions, faults, observer=observer)
        """Pushes failures to the ranks bound to a request, bounded per client."""
        self._faults = faults
        self._closed = closed
        """Whether the server is shutting down: failures are no longer told then."""

    async def start(self, nursery: trio.Nursery) -> None:
        await nursery.start(self.completions.run)
        await nursery.start(self.notices.run)

    def tell(
        self,
        record: RequestRecord,
        failure: Failure,
        *,
        only: Endpoint | None = None,
        client: str | None = None,
    ) -> None:
        """Push the request's failure, in the background, to the endpoints bound to it that
        were not told yet (``only``: to that one, if it is bound), charged to ``client`` (by
        default each endpoint's own). An endpoint a request never bound is never told, and
        nobody once the server is shutting down."""
        if self._closed():
            return
        if only is None:
            targets = {e: c for e, c in record.endpoints.items() if e not in record.told}
        elif only in record.endpoints and only not in record.told:
            targets = {only: client or record.endpoints[only]}
        else:
            return
        if not targets:
            return
        record.told.update(targets)
        part = record.part
        try:
            message = CompletionMessage.failed(
                record.req_id,
                part.num_parts,
                part.part_idx,
                failure.message,
                failure.error_type.status,
            ).to_bytes()
        except ValueError as exc:  # a part no message can carry: a bug upstream
            self._faults.record("failure_message", exc)
            return
        self.notices.notify(record.req_id, message, targets)

    async def done(
        self, req_id: str, record: RequestRecord | None, notify: Notify, report: SendReport
    ) -> None:
        """Deliver the rank's completion message (its bytes landed), or raise
        :class:`CompletionFailed` naming the endpoint."""
        part = record.part if record is not None else Part(notify.part_idx + 1, notify.part_idx)
        shape = report.shape
        try:
            message = CompletionMessage(
                req_id,
                part.num_parts,
                part.part_idx,
                grid_dim=grid_dim(shape.grids),
                shape=(shape.rows, shape.dim),
                dtype=shape.dtype,
                modality=shape.media.modality,
                meta=shape.media.meta,
            ).to_bytes()
        except ValueError as exc:
            raise CompletionFailed(
                f"no completion message for {notify.endpoint.address} can carry this "
                f"request: {exc}",
                req_id=req_id,
            ) from None
        try:
            await self.completions.push(notify.endpoint, message, kind="done")
        except CompletionFailed as exc:
            exc.req_id = req_id
            log.error("%s", exc.message, extra={"req_id": req_id})
            raise
