"""SGLang's split of a prefill request into parts, one per encode server (ids
``{rid}_local_part_{i}``), and where a request's completion messages go."""

from __future__ import annotations

import re
from dataclasses import dataclass

from trio_encode.completion import Endpoint


@dataclass(frozen=True)
class Part:
    """Where a request sits in SGLang's split of a prefill request (one part per encode
    server, ids ``{rid}_local_part_{i}``), and the prefill ranks its ``/encode`` named."""

    num_parts: int = 1
    part_idx: int = 0
    endpoints: tuple[Endpoint, ...] = ()

    @staticmethod
    def family(req_id: str, part: Part) -> str | None:
        """The request's id without its part suffix, when it is a part of several: siblings
        share it. None for a whole request."""
        match = PART_ID.match(req_id)
        if part.num_parts < 2 or match is None or int(match.group(2)) != part.part_idx:
            return None
        return match.group(1)


@dataclass(frozen=True)
class Notify:
    """Where a ``/send`` wants SGLang's completion message: the prefill rank's socket, and the
    part of the request the send carries (used when its ``/encode`` named none)."""

    endpoint: Endpoint
    part_idx: int = 0


PART_ID = re.compile(r"^(.*)_local_part_([0-9]+)$")


def part_of(req_id: str) -> tuple[str, int] | None:
    """``(rid, index)`` when ``req_id`` is written as SGLang writes part ``index`` of ``rid``
    (``{rid}_local_part_{index}``, the index without leading zeros); None otherwise."""
    match = PART_ID.match(req_id)
    if match is None or (len(match.group(2)) > 1 and match.group(2).startswith("0")):
        return None
    return match.group(1), int(match.group(2))


def family_of(req_id: str) -> str | None:
    part = part_of(req_id)
    return None if part is None else part[0]


MAX_ENDPOINTS = 64
"""Prefill endpoints one request may have bound, over all its calls. A rank has one endpoint,
and the ranks that receive a request are its prefill's tensor-parallel ranks: 64 is eight
nodes of 8 GPUs, above the layouts SGLang documents (TP 8 to 32). It keeps what one request
can make the server push, and remember, small: a client naming thousands of ports gets a 400."""
UNKNOWN_CLIENT = "unknown"
"""The client of a call whose caller did not say (error pushes are bounded per client)."""
