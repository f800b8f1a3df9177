"""What the service keeps beside each request's scope, live and for a while after it ended:
its part, the prefill endpoints bound to it, its failure; indexed by req_id and by the family
of parts it belongs to. One table, so what a late call or a failed sibling needs is found in
one place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trio_encode.completion import Endpoint
from trio_encode.ending import Failure
from trio_encode.recent import Recent
from trio_encode.service.parts import PART_ID, Part, family_of, part_of

REMEMBER_FAILURES = 10_000
"""Failed requests remembered for their late pulls, at most; as many families of parts."""
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


class Requests:
    """The records of live requests (by req_id and by family), of ended ones that bound
    endpoints, and the failures of requests and of part families; every memory of ended ones
    bounded by count and by ``window`` seconds (the pull timeout)."""

    def __init__(self, window: Callable[[], float]) -> None:
        self._live: dict[str, RequestRecord] = {}
        self._families: dict[str, dict[str, RequestRecord]] = {}
        """Live records whose id names a part, by the id of the request they are parts of."""
        self._ended: Recent[str, RequestRecord] = Recent(REMEMBER_ENDED, window)
        """Recently ended requests (and refused ones that named endpoints)."""
        self._failures: Recent[str, Failure] = Recent(REMEMBER_FAILURES, window)
        """Recent failures by req_id. A pull arriving after its request failed gets the
        failure at once, also where the scope left no tombstone (bad input, after which a
        corrected /encode may reuse the id and clears the entry)."""
        self._family_failures: Recent[str, Failure] = Recent(REMEMBER_FAILURES, window)
        """Recent failures of part families: what each sibling part of a failed part gets."""

    def live(self, req_id: str) -> RequestRecord | None:
        return self._live.get(req_id)

    def record(self, req_id: str) -> RequestRecord | None:
        """The request's record: live, or ended lately (and remembered)."""
        return self._live.get(req_id) or self._ended.get(req_id)

    def track(self, record: RequestRecord) -> None:
        """``record`` is its request's live one from now (a stale one, whose scope has just
        ended and whose watcher has not run yet, is replaced)."""
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

    def failed(self, req_id: str, failure: Failure) -> None:
        self._failures.remember(req_id, failure)

    def retried(self, req_id: str) -> None:
        """A corrected retry of a bad request opened a scope: its old failure no longer
        answers."""
        self._failures.forget(req_id)

    def failure(self, req_id: str) -> Failure | None:
        return self._failures.get(req_id)

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
