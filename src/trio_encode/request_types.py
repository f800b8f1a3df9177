"""The values a request's scope deals in: the embedding's memory as the scope sees it, a
receiver, the facts that outlive the embedding, and the answer to a send.

Kept apart from :mod:`trio_encode.scope` so that the service, the HTTP layer and tests can name
them without importing the lifecycle machinery.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

EndReason = Literal[
    "completed",
    "encode_failed",
    "invalid_input",
    "refused",
    "failed",
    "expired",
    "shutdown",
    "abandoned",
]
"""Why a scope ended. ``invalid_input`` and ``refused`` (a transient 503 from the encoder)
leave no tombstone, so the client may retry the same ``req_id``; ``failed`` is an unexpected
error inside the scope (a bug), answered 500; ``abandoned``: a sibling part of the same
prefill request failed, so its ranks will never send this one."""


Grid = tuple[int, ...]
"""The patch grid a vision model used for one image, e.g. ``(t, h, w)`` for Qwen-VL models,
whose prefill counts an image's tokens from it (``t * h * w // merge_size**2``)."""


def grid_dim(grids: Sequence[Grid | None]) -> list[list[int]] | None:
    """The grids as SGLang carries them (``grid_dim``): one list per image, or None when the
    model has no per-image grid (fixed-grid towers such as CLIP, SigLIP, the built-in ViT)."""
    if not grids or all(grid is None for grid in grids):
        return None
    return [list(grid) for grid in grids if grid is not None]


def check_grids(grids: Sequence[Grid | None]) -> tuple[Grid | None, ...]:
    """``grids`` as a tuple; every image has a grid or none has (one model made them)."""
    present = sum(grid is not None for grid in grids)
    if 0 < present < len(grids):
        raise ValueError("either every image has a grid or none has")
    return tuple(grids)


MediaMeta = tuple[tuple[str, float | list[float] | list[list[float]]], ...]
"""Metadata SGLang's prefill reads beside a part's rows, by name, in the order it is sent."""


@dataclass(frozen=True)
class Media:
    """Which of SGLang's modalities a part's rows are, and what its prefill reads beside them
    (a video part's ``video_timestamps`` or ``second_per_grid_ts``); its grids are the
    modality's (``image_grid_thw``, ``video_grid_thw``, an audio part's clip lengths)."""

    modality: str = "IMAGE"
    """SGLang's ``Modality`` member name: ``IMAGE``, ``VIDEO`` or ``AUDIO``."""
    meta: MediaMeta = ()


IMAGES = Media()
"""A part of images (no metadata beside the grids)."""


class EmbeddingMemory(Protocol):
    """What a scope needs to know about an embedding: where its bytes lie, and its shape."""

    @property
    def address(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def rows(self) -> int: ...

    @property
    def dim(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def checksum(self) -> str:
        """``algorithm:hex`` of the bytes; computed once, may be slow the first time."""
        ...

    @property
    def image_lens(self) -> tuple[int, ...]:
        """Rows of each image, in order (the image tokens its prompt holds); they add up to
        ``rows``."""
        ...

    @property
    def grids(self) -> Sequence[Grid | None]:
        """Per image, in order, the grid its model used (None: a fixed grid); empty when
        the encoder reported none."""
        ...

    @property
    def media(self) -> Media:
        """The part's modality and metadata."""
        ...

    @property
    def segments(self) -> Sequence[tuple[int, int]]:
        """``(address, length)`` of each piece, in the order a receiver gets them back to back;
        one piece for a contiguous embedding, one per image for arena segments."""
        ...

    def copy(self) -> EmbeddingMemory:
        """The same bytes in fresh memory."""
        ...

    def release(self) -> None:
        """Give back what the embedding holds beyond its memory (arena leases); called once,
        on the event loop, after every transfer from it has returned."""
        ...


Encode = Callable[[], Awaitable[EmbeddingMemory]]


@dataclass(frozen=True)
class EmbeddingShape:
    """Facts about an embedding that outlive it (answers are built after it is dropped)."""

    rows: int
    dim: int
    nbytes: int
    dtype: str
    checksum: str
    """``algorithm:hex`` digest of the bytes every receiver gets, so a receiver can prove
    that what landed is what was encoded."""
    grids: tuple[Grid | None, ...] = ()
    """Per image, the grid the model used (see :attr:`EmbeddingMemory.grids`)."""
    image_lens: tuple[int, ...] = ()
    """Rows of each image, in order (see :attr:`EmbeddingMemory.image_lens`)."""
    media: Media = IMAGES
    """The part's modality and metadata (see :class:`Media`)."""


@dataclass(frozen=True)
class Receiver:
    """A landing buffer; a retry from the same one is the same receiver."""

    session_id: str
    buffer_address: int


@dataclass(frozen=True)
class SendReport:
    shape: EmbeddingShape
    receivers_done: int
    receive_count: int
    repeat: bool = False
    """True when this receiver had already been sent to and the request had completed: the
    answer to a retry whose first 200 was lost. No bytes moved this time."""
