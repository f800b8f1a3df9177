"""Which encoder a request goes to: rendezvous (highest random weight) hashing by content.

Every encoder gets a pseudo-random score from the pair (encoder, request content); the
encoders are tried in order of falling score. The score depends on nothing else, so:

- TP siblings, which send the same ``mm_items``, rank the encoders identically and meet at
  the same encoder without talking to each other;
- identical images from unrelated requests meet at the same encoder too, where its in-flight
  de-duplication and its cache serve them once for the whole cluster;
- adding or removing an encoder moves only the keys whose top choice it is (about ``1/n`` of
  them); every other key keeps its encoder and its warm cache.

Scores come from BLAKE2b, not Python's ``hash``, so every process computes the same ranking.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence


def content_digest(mm_items: Sequence[str], modality: str = "IMAGE") -> bytes:
    """The routing key of a request: a digest of its ``mm_items`` in order and, for a part
    of another modality than ``IMAGE`` (a ``VIDEO`` part), of that modality. The same items
    sent as another modality are other rows (the encoders key them apart), so they route on
    their own; an image part's key is the items' alone."""
    digest = hashlib.blake2b(digest_size=16)
    if modality != "IMAGE":
        # Personalised, so no item's digest can stand for a modality's.
        digest.update(
            hashlib.blake2b(modality.encode(), digest_size=16, person=b"modality").digest()
        )
    for item in mm_items:
        # Each item's own digest, so no two different lists can concatenate to the same bytes.
        digest.update(hashlib.blake2b(item.encode(), digest_size=16).digest())
    return digest.digest()


def request_digest(req_id: str) -> bytes:
    """A routing key from the request's id alone: no affinity between requests."""
    return hashlib.blake2b(req_id.encode(), digest_size=16).digest()


def score(encoder: str, digest: bytes) -> int:
    """The weight of ``encoder`` for content ``digest``: a 64-bit pseudo-random number."""
    mixed = hashlib.blake2b(digest, key=encoder.encode()[:64], digest_size=8)
    mixed.update(encoder.encode())  # names longer than the 64-byte key still count in full
    return int.from_bytes(mixed.digest(), "big")


def rank(encoders: Iterable[str], digest: bytes) -> list[str]:
    """``encoders`` (duplicates dropped) best first for ``digest``; ties by name, so the order
    is total and the same in every process."""
    unique = set(encoders)
    return sorted(unique, key=lambda encoder: (-score(encoder, digest), encoder))
