"""From an ``mm_items`` string to image bytes, and from bytes to normalised pixels.

Everything a client sends is untrusted: sizes are checked before any buffer is decoded, only
the decoders of the formats below are ever run (Pillow's others, with their larger attack
surface, never see client bytes), and every failure becomes an :class:`InvalidInput` whose
message says what to change. An animated GIF, WebP or PNG contributes its first frame, and no
other frame is ever decoded.

A decode's cost is bounded before it is paid: the pixel count from the header, and the file's
structure (scans, chunks, blocks, frames) from a pre-scan of its bytes (``image_scan.py``).
A CPU-time budget per image backs both up wherever the decode can be stopped.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from trio_encode.encoder.image_scan import ImageTooComplex, scan
from trio_encode.errors import InvalidInput

# The media types a data URI may carry, and the Pillow decoder each one names.
_DATA_URI_TYPES = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/webp": "WEBP",
    "image/gif": "GIF",
    "image/bmp": "BMP",
}
_FILE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp"}
# Whatever the URI's media type says, only these decoders run, each sniffing its own magic.
_FORMATS = tuple(dict.fromkeys(_DATA_URI_TYPES.values()))
_FORMAT_NAMES = "PNG, JPEG, WebP, GIF or BMP"


@dataclass(frozen=True)
class MediaKind:
    """What a modality's ``mm_items`` entries may be: the media types a data URI may carry and
    the suffixes a file may end in (the decoder checks the bytes themselves)."""

    noun: str
    types: frozenset[str]
    suffixes: frozenset[str]
    names: str
    """The formats, for messages."""
    example: str
    """A media type to show in messages."""


IMAGE_ITEMS = MediaKind(
    "image", frozenset(_DATA_URI_TYPES), frozenset(_FILE_SUFFIXES), _FORMAT_NAMES, "image/png"
)

DECODE_BUDGET_S = 5.0
"""CPU seconds one image's decode may take (header and pixels). A 40 MP PNG or progressive
JPEG (the default pixel limit) took 0.7 s where these were measured, a JPEG at the scan
bounds of ``image_scan.py`` 1.5 s: this leaves room for slower cores, and is a backstop
to the pre-scan, which refuses hostile files long before. Thread CPU time, not wall time: a
decode waiting for a core is not the one being slow."""

# The budget is CPU time, but reading that clock is a system call (~0.5 us, as long as a
# small read): it is read only when the wall clock says the budget could be spent, since a
# thread cannot use more CPU time than has passed. Tests replace both.
_cpu_clock = time.thread_time
_wall_clock = time.monotonic


class ImageTooBig(InvalidInput):
    """An image is larger than the bytes it may have (its own limit, or what is left of its
    request's); the caller says which limit that was."""


@dataclass(frozen=True)
class Preprocess:
    """How a model wants its pixels: square side, per-channel mean and std, and whether to
    resize the short side and centre-crop (CLIP) or resize straight to a square.

    ``prepare``, when set, replaces all of that: it turns the decoded, upright RGB image into
    the ``(3, image_size, image_size)`` float32 tensor itself (a Hugging Face model's own
    image processor, so its inputs are exactly those it was trained on)."""

    image_size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    center_crop: bool = False
    prepare: Callable[[Image.Image], torch.Tensor] | None = None


def load_item(
    item: str, *, max_bytes: int, media_dir: Path | None = None, kind: MediaKind = IMAGE_ITEMS
) -> bytes:
    """The encoded bytes of one ``mm_items`` entry: a data URI of ``kind``, or a file path
    that lies inside ``media_dir`` (paths are refused when no ``media_dir`` is configured)."""
    if item.startswith("data:"):
        return _from_data_uri(item, max_bytes, kind)
    if media_dir is None:
        raise InvalidInput(
            f"mm_items entries must be data:{kind.noun}/...;base64,... URIs of a "
            f"{kind.names} {kind.noun} (this server has no media directory, so file paths are "
            "not accepted)"
        )
    return _from_media_dir(item, media_dir, max_bytes, kind)


def _from_data_uri(item: str, max_bytes: int, kind: MediaKind) -> bytes:
    header, comma, payload = item.partition(",")
    if not comma:
        raise InvalidInput("malformed data URI: no ',' between the header and the data")
    media_type, _, encoding = header.removeprefix("data:").partition(";")
    media_type = media_type.strip().lower()
    noun = kind.noun
    if media_type not in kind.types:
        supported = ", ".join(sorted(kind.types))
        raise InvalidInput(
            f"unsupported {noun} type {media_type or '(none)'!r}: send one of {supported}"
        )
    if encoding.strip().lower() != "base64":
        raise InvalidInput(
            f"{noun} data URIs must be base64-encoded (data:{kind.example};base64,...)"
        )
    # Refuse before decoding: base64 grows data by 4/3, so this bounds the decoded size.
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise ImageTooBig(_too_big(len(payload) // 4 * 3, max_bytes, noun=noun))
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f"the {noun} data is not valid base64: {exc}") from None
    if len(data) > max_bytes:
        raise ImageTooBig(_too_big(len(data), max_bytes, noun=noun))
    if not data:
        raise InvalidInput(f"the {noun} data URI is empty")
    return data


def _from_media_dir(item: str, media_dir: Path, max_bytes: int, kind: MediaKind) -> bytes:
    # Missing, outside the directory, unreadable or not a file: one message for all, so a
    # client cannot learn which paths exist on the host (``/etc/shadow`` versus a typo).
    noun = kind.noun
    unusable = InvalidInput(
        f"no readable {noun} file {item!r} in the media directory (paths are relative to it)"
    )
    if Path(item).suffix.lower() not in kind.suffixes:  # before the disk is looked at
        suffixes = ", ".join(sorted(kind.suffixes))
        raise InvalidInput(f"{noun} file {item!r} must end in one of {suffixes}")
    root = media_dir.resolve()
    try:
        path = (root / item.removeprefix("file://")).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):
        raise unusable from None
    if not path.is_relative_to(root) or not path.is_file():
        raise unusable
    if path.suffix.lower() not in kind.suffixes:  # a link inside to a file of another kind
        raise unusable
    try:
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)
    except OSError:
        raise unusable from None
    if len(data) > max_bytes:
        raise ImageTooBig(_too_big(len(data), max_bytes, at_least=True, noun=noun))
    return data


def _too_big(size: int, max_bytes: int, *, at_least: bool = False, noun: str = "image") -> str:
    more = "more than " if at_least else ""
    return f"{noun} is {more}{size} bytes; the limit is {max_bytes} bytes per {noun}"


def decode_image(
    data: bytes, preprocess: Preprocess, *, max_pixels: int, budget_s: float = DECODE_BUDGET_S
) -> torch.Tensor:
    """Decode image bytes to a normalised float32 ``(3, S, S)`` tensor.

    The pixel count is checked from the header and the structure from a pre-scan, before the
    image is decoded, so a small file that declares huge dimensions, or thousands of scans or
    chunks, costs nothing; ``budget_s`` bounds the decode's CPU time (see :func:`open_image`).
    Blocking: call it from a worker thread.
    """
    # JPEG can decode at 1/2..1/8 scale directly, never below the size we need; a model's own
    # processor gets the full image, as it would in transformers.
    draft = preprocess.image_size if preprocess.prepare is None else None
    rgb = open_image(data, max_pixels=max_pixels, draft=draft, budget_s=budget_s)
    if preprocess.prepare is not None:
        return preprocess.prepare(rgb)
    return _normalise(_resize(rgb, preprocess), preprocess)


class _Budgeted(io.BytesIO):
    """The image's bytes as Pillow reads them, with the decode's CPU-time budget checked on
    every read. Once the header is parsed, a JPEG's reads also stop at each start of scan, so
    that libjpeg gets one scan per call and the budget is checked between scans.

    What runs inside one decoder call cannot be stopped: a WebP frame (libwebp decodes it
    whole when Pillow loads it), libjpeg's final pass over a progressive image's coefficients,
    and the pixels that one read (at most 64 KiB) of PNG or GIF data expands to. Those are
    bounded by the pixel limit and the pre-scan, not by this budget."""

    def __init__(self, data: bytes, budget_s: float) -> None:
        super().__init__(data)
        self.budget_s = budget_s
        self.deadline = _cpu_clock() + budget_s
        self.next_check = _wall_clock() + budget_s
        self.stops: tuple[int, ...] = ()

    def read(self, size: int | None = -1, /) -> bytes:
        if _wall_clock() >= self.next_check:
            cpu_left = self.deadline - _cpu_clock()
            if cpu_left < 0:
                raise ImageTooComplex(
                    f"decoding the image took more than {self.budget_s:g} s of CPU time, the "
                    "limit per image; it was stopped"
                )
            self.next_check = _wall_clock() + cpu_left
        if self.stops:
            at = self.tell()
            index = bisect.bisect_right(self.stops, at)
            if index < len(self.stops):
                to_stop = self.stops[index] - at
                size = to_stop if size is None or size < 0 else min(size, to_stop)
        return super().read(size)


def _open(data: bytes, max_pixels: int, budget_s: float) -> Image.Image:
    """The image with only its header read, its structure and size checked, reading through a
    :class:`_Budgeted` whose budget runs from now."""
    layout = scan(data, max_pixels=max_pixels)  # raises ImageTooComplex
    if layout.size is not None and layout.size[0] * layout.size[1] > max_pixels:
        raise InvalidInput(_bomb(layout.size, max_pixels))  # before Pillow allocates it
    # Pillow's BMP RLE decoder reads one byte at a time, in Python: a hook on every read would
    # double its cost, which is linear in the file's bytes anyway (~2 s for 20 MiB at worst),
    # and an uncompressed BMP is a plain copy. So a BMP is read without the budget.
    reader = io.BytesIO(data) if data.startswith(b"BM") else _Budgeted(data, budget_s)
    try:
        image = Image.open(reader, formats=_FORMATS)
    except UnidentifiedImageError:
        raise InvalidInput(f"the data is not a {_FORMAT_NAMES} image") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidInput(_bomb(None, max_pixels)) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidInput(f"the image header cannot be read: {exc}") from None
    width, height = image.size
    if width <= 0 or height <= 0 or width * height > max_pixels:
        image.close()
        if width <= 0 or height <= 0:
            raise InvalidInput(f"the image has no pixels ({width}x{height})")
        raise InvalidInput(_bomb((width, height), max_pixels))
    if isinstance(reader, _Budgeted):
        # Pillow reads a header's parts whole; only the decode's reads may stop short.
        reader.stops = layout.scan_starts
    return image


def image_pixels(data: bytes, *, max_pixels: int, budget_s: float = DECODE_BUDGET_S) -> int:
    """Width x height from the image's header alone (nothing is decoded), for the per-request
    pixel budget. Raises :class:`InvalidInput` as :func:`decode_image` would for the header
    and the structure."""
    with _open(data, max_pixels, budget_s) as image:
        width, height = image.size
        return int(width * height)


def open_image(
    data: bytes,
    *,
    max_pixels: int,
    draft: int | None = None,
    budget_s: float = DECODE_BUDGET_S,
) -> Image.Image:
    """Decode image bytes to an upright RGB image (EXIF rotation applied), checking the pixel
    count from the header and the structure from a pre-scan first. ``draft``: a JPEG may be
    decoded at a reduced scale that keeps both sides at least this. A decode past
    ``budget_s`` CPU seconds is stopped at its next read (see :class:`_Budgeted`) with
    :class:`ImageTooComplex`. Blocking: call it from a worker thread."""
    with _open(data, max_pixels, budget_s) as image:
        width, height = image.size
        try:
            if draft is not None:
                image.draft("RGB", (draft, draft))
            # Cameras store rotation in EXIF; the model must see the photo upright.
            ImageOps.exif_transpose(image, in_place=True)
            return image.convert("RGB")
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise InvalidInput(_bomb((width, height), max_pixels)) from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise InvalidInput(f"the image is corrupt or truncated: {exc}") from None


def _bomb(size: tuple[int, int] | None, max_pixels: int) -> str:
    declared = f" declares {size[0]}x{size[1]} pixels" if size else " is too large"
    return f"the image{declared}; the limit is {max_pixels} pixels (width x height)"


def _resize(image: Image.Image, preprocess: Preprocess) -> Image.Image:
    side = preprocess.image_size
    if not preprocess.center_crop:
        return image.resize((side, side), Image.Resampling.BICUBIC, reducing_gap=3.0)
    scale = side / min(image.size)
    width = max(side, round(image.width * scale))
    height = max(side, round(image.height * scale))
    image = image.resize((width, height), Image.Resampling.BICUBIC, reducing_gap=3.0)
    left, top = (width - side) // 2, (height - side) // 2
    return image.crop((left, top, left + side, top + side))


def _normalise(image: Image.Image, preprocess: Preprocess) -> torch.Tensor:
    array = np.asarray(image, dtype=np.uint8)  # (H, W, 3)
    pixels = torch.from_numpy(array.copy()).permute(2, 0, 1).to(torch.float32).div_(255.0)
    mean = torch.tensor(preprocess.mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(preprocess.std, dtype=torch.float32).view(3, 1, 1)
    return pixels.sub_(mean).div_(std).contiguous()
