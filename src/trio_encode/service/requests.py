"""What the service keeps beside each request's scope, live and for a while after it ended:
its part, the prefill endpoints bound to it, the host its receivers must be on; indexed by
req_id and by the family of parts it belongs to; and the failures of part families. One table,
so what a failed sibling or a late send's error push needs is found in one place. (How a
request itself ended is its tombstone's, in the scope registry.)"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from trio_encode.completion import Endpoint
from trio_encode.errors import InvalidInput
from trio_encode.recent import Recent
from trio_encode.request_state import Failure
from trio_encode.service.parts import MAX_ENDPOINTS, PART_ID, Part, family_of, part_of

log = logging.getLogger(__name__)

REMEMBER_FAILURES = 10_000
"""Failed families of parts remembered for their other parts, at most."""
REMEMBER_ENDED = 1024
"""Ended requests whose bound endpoints are remembered (for ``pull_timeout``), so that a late
``/send``'s error still reaches its rank; at most ``REMEMBER_ENDED * MAX_ENDPOINTS``
endpoints (about 10 MiB)."""


@dataclass(eq=False)
class RequestRecord:
    """What the service keeps beside a request's scope, and for a while after it ended: its
    part and the prefill endpoints bound to it (those its ``/encode`` calls named, and those of
    the ``/send`` calls it admitted), each with the client that named it. Only these are ever
    sent the request's failure, each at most once."""

    req_id: str
    part: Part
    endpoints: dict[Endpoint, str] = field(default_factory=dict)
    told: set[Endpoint] = field(default_factory=set)
    """Bound endpoints already sent (or being sent) the request's failure."""
    full: bool = False
    """A /send's endpoint found no room (logged once)."""
    prefill_host: str | None = None
    """The host every receiver of the request must be on (when its /encode named one and
    ``receivers_match_prefill_host`` is on)."""

    def bind(self, endpoint: Endpoint, client: str) -> None:
        """Bind a send's endpoint (so the request's failure may be told there), unless
        ``MAX_ENDPOINTS`` are bound already: then one log line, and the send goes on (its own
        completion message does not need the binding)."""
        if endpoint in self.endpoints:
            return
        if len(self.endpoints) < MAX_ENDPOINTS:
            self.endpoints[endpoint] = client
        elif not self.full:
            self.full = True
            log.warning(
                "request has %d prefill endpoints bound, the most; /send endpoints beyond "
                "them are not told of its failure",
                MAX_ENDPOINTS,
                extra={"req_id": self.req_id},
            )


def check_room(req_id: str, bound: dict[Endpoint, str], named: dict[Endpoint, str]) -> None:
    """Refuse (400) a call that would bind more than ``MAX_ENDPOINTS`` endpoints to its
    request: before anything is looked up or changed."""
    if len(named) <= MAX_ENDPOINTS - len(bound):
        return
    total = len(bound) + sum(1 for endpoint in named if endpoint not in bound)
    if total > MAX_ENDPOINTS:
        raise InvalidInput(
            f"this call would give the request {total} prefill endpoints (prefill_host "
            f"with each embedding_port, over all its calls); at most {MAX_ENDPOINTS} are "
            "accepted",
            req_id=req_id,
        )


class Requests:
    """The records of live requests (by req_id and by family), of ended ones that bound
    endpoints, and the failures of part families; every memory of ended ones bounded by count
    and by ``window`` seconds (the pull timeout)."""

    def __init__(self, window: Callable[[], float]) -> None:
        self._live: dict[str, RequestRecord] = {}
        self._families: dict[str, dict[str, RequestRecord]] = {}
        """Live records whose id names a part, by the id of the request they are parts of."""
        self._ended: Recent[str, RequestRecord] = Recent(REMEMBER_ENDED, window)
        """Recently ended requests (and refused ones that named endpoints)."""
        self._family_failures: Recent[str, Failure] = Recent(REMEMBER_FAILURES, window)
        """Recent failures of part families: what each sibling part of a failed part gets."""

    def live(self, req_id: str) -> RequestRecord | None:
        return self._live.get(req_id)

    def record(self, req_id: str) -> RequestRecord | None:
        """The request's record: live, or ended lately (and remembered)."""
        return self._live.get(req_id) or self._ended.get(req_id)

    def track(self, record: RequestRecord) -> None:
        """``record`` is its request's live one from now."""
        self._live[record.req_id] = record
        family = family_of(record.req_id)
        if family is not None:
            self._families.setdefault(family, {})[record.req_id] = record

    def untrack(self, record: RequestRecord) -> None:
        """Forget ``record`` as live, unless a newer one took its place."""
        if self._live.get(record.req_id) is record:
            del self._live[record.req_id]
        family = family_of(record.req_id)
        if family is None:
            return
        members = self._families.get(family)
        if members is not None and members.get(record.req_id) is record:
            del members[record.req_id]
            if not members:
                del self._families[family]

    def ended(self, record: RequestRecord) -> None:
        """Keep an ended request's endpoints for its late sends' errors (bounded)."""
        if record.endpoints:
            self._ended.remember(record.req_id, record)

    def family_failed(self, family: str, failure: Failure) -> None:
        self._family_failures.remember(family, failure)

    def family_failure(self, req_id: str, part: Part | None = None) -> Failure | None:
        """The failure of a sibling part of ``req_id``'s request (``part``, when known, must
        place it among several parts)."""
        match = PART_ID.match(req_id)
        if match is None or (part is not None and Part.family(req_id, part) is None):
            return None
        return self._family_failures.get(match.group(1))

    def family_members(self, family: str) -> list[str]:
        """The req_ids of the live parts of ``family``."""
        return list(self._families.get(family, ()))

    @staticmethod
    def siblings(family: str, req_id: str, part: Part, ids: list[str]) -> list[str]:
        """Of ``ids`` (all of ``family``), the other parts of ``part``'s request."""
        siblings = []
        for other in ids:
            where = part_of(other)
            if other == req_id or where is None:
                continue
            other_family, index = where
            if other_family == family and index < part.num_parts:
                siblings.append(other)
        return siblings
