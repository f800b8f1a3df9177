"""Property-based fuzzing of what turns a client's ``mm_items`` into image bytes and pixels.

Two entry points take untrusted input:

- image bytes (inline, read from a file or fetched) go to the header check
  (:func:`~trio_encode.encoder.images.image_pixels`, the request pixel budget) and the decoders
  (:func:`~trio_encode.encoder.images.decode_image` for a fixed-grid model,
  :func:`~trio_encode.encoder.images.open_image` for a VLM's processor);
- ``mm_items`` strings go to :meth:`ImageEncoder.load_items`: data URIs, ``http(s)`` URLs
  (fetched), paths inside the media directory.

For any input, each either succeeds with a sane result or raises :class:`InvalidInput` (400
``invalid_input``: the client's fault, said in words) within a time bound: anything else is a
500 ``internal`` for a client's typo, and a slow input holds a decode thread. Inputs: arbitrary
bytes, bytes behind each format's magic, and valid PNG, JPEG (EXIF-rotated, progressive), GIF
(animated), WebP and BMP files mutated byte by byte; data URIs with odd media types and odd
base64; URLs with odd schemes, hosts (empty and overlong labels, punycode, unicode, numeric
forms), huge ports, and redirects to such URLs; paths escaping the media directory; any
unicode, lone surrogates included (a JSON body can carry them).

Nothing reaches the network: host names resolve through a fake resolver (loopback, one public
address, or "no such name"), and every HTTP exchange is answered by a mock transport whose
answer each example draws (an image, garbage, a redirect to a drawn URL, an error status, a
compressed body, a failed connection).

The normal run keeps each property to a couple of hundred examples; the ``hostile`` variants
(``nox -s hostile``, ``pytest -m hostile``) run thousands, with the server's default pixel
limit.
"""

from __future__ import annotations

import base64
import io
import socket
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from support.fake_encoder import FakeBackend, inline
from trio_encode.encoder import ImageEncoder
from trio_encode.encoder.images import Preprocess, decode_image, image_pixels, open_image
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.errors import InvalidInput

BOUND_S = 5.0
"""No call on one input may take longer (the inputs are at most a few KB, the pixels bounded):
longer is a hang, not a slow machine."""
MAX_PIXELS = 1 << 20
"""The per-image pixel limit of the normal run (the hostile run uses the server's default)."""
NORMAL = settings(
    max_examples=200,
    derandomize=True,  # the same examples every run: the normal suite stays reproducible
    deadline=timedelta(seconds=BOUND_S),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HOSTILE = settings(
    max_examples=5000,
    deadline=timedelta(seconds=BOUND_S),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
pytestmark = [
    # Pillow warns (and goes on) about a header declaring more pixels than its own limit, and
    # about corrupt EXIF; neither is what these properties judge.
    pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


# -- valid images of every accepted format, to mutate -------------------------------------------


def _saved(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _seeds() -> dict[str, bytes]:
    rgb = Image.new("RGB", (12, 9), (10, 200, 30))
    rgb.paste((250, 0, 90), (3, 2, 8, 6))
    rotated = Image.Exif()
    rotated[0x0112] = 6  # Orientation: rotate 90 degrees on display
    frames = [Image.new("RGB", (8, 6), colour) for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 9))]
    return {
        "png": _saved(rgb, "PNG"),
        "png-rgba": _saved(Image.new("RGBA", (7, 5), (1, 2, 3, 4)), "PNG"),
        "png-palette": _saved(rgb.convert("P"), "PNG"),
        "png-exif": _saved(rgb, "PNG", exif=rotated),
        "jpeg": _saved(rgb, "JPEG"),
        "jpeg-exif": _saved(rgb, "JPEG", exif=rotated),
        "jpeg-progressive": _saved(rgb.convert("L"), "JPEG", progressive=True),
        "jpeg-cmyk": _saved(rgb.convert("CMYK"), "JPEG"),
        "gif": _saved(rgb, "GIF"),
        "gif-animated": _saved(frames[0], "GIF", save_all=True, append_images=frames[1:]),
        "webp": _saved(rgb, "WEBP"),
        "webp-lossless": _saved(rgb, "WEBP", lossless=True),
        "webp-alpha-exif": _saved(Image.new("RGBA", (7, 5)), "WEBP", exif=rotated),
        "webp-animated": _saved(frames[0], "WEBP", save_all=True, append_images=frames[1:]),
        "bmp": _saved(rgb, "BMP"),
        "bmp-1bit": _saved(Image.new("1", (9, 3), 1), "BMP"),
        "bmp-palette": _saved(rgb.convert("P"), "BMP"),
    }


SEEDS = _seeds()
MAGICS = [
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff",
    b"GIF87a",
    b"GIF89a",
    b"RIFF\0\0\0\0WEBPVP8",
    b"BM",
]
SPECIAL = [
    b"\x00",
    b"\xff",
    b"\x7f",
    b"\x80",
    b"\x00\x00\x00\x00",
    b"\xff\xff\xff\xff",
    b"\x7f\xff",
]


@st.composite
def mutated_images(draw: st.DrawFn) -> bytes:
    """A valid image of one format with 1-8 mutations: bytes set, inserted, deleted, words
    overwritten with extreme values (sizes, lengths), truncated, or spliced with another."""
    data = bytearray(SEEDS[draw(st.sampled_from(sorted(SEEDS)))])
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["set", "insert", "delete", "special", "truncate", "splice"]))
        if op == "set" and data:
            data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 32))]
        elif op == "special":
            word = draw(st.sampled_from(SPECIAL))
            data[at : at + len(word)] = word
        elif op == "truncate":
            del data[at:]
        elif op == "splice":
            other = SEEDS[draw(st.sampled_from(sorted(SEEDS)))]
            cut = draw(st.integers(0, len(other)))
            data[at:] = other[cut:]
    return bytes(data)


def size_fields(data: bytes) -> list[tuple[int, str]]:
    """Where a seed declares its width and height: ``(offset, struct format)`` of each."""
    if data.startswith(b"\x89PNG"):
        return [(16, ">I"), (20, ">I")]
    if data.startswith(b"GIF"):
        fields = [(6, "<H"), (8, "<H")]
        descriptor = data.find(b"\x2c\x00\x00\x00\x00", 13)
        if descriptor > 0:
            fields += [(descriptor + 5, "<H"), (descriptor + 7, "<H")]
        return fields
    if data.startswith(b"BM"):
        return [(18, "<i"), (22, "<i")]
    if data.startswith(b"\xff\xd8"):
        sof = max(data.find(b"\xff\xc0"), data.find(b"\xff\xc2"))
        return [(sof + 5, ">H"), (sof + 7, ">H")] if sof > 0 else []
    if data[8:16] == b"WEBPVP8X":
        return [(24, "<H"), (27, "<H")]  # the canvas's sides minus one, low 16 of 24 bits
    if data[8:16] == b"WEBPVP8 ":
        return [(26, "<H"), (28, "<H")]  # 14 bits of size, 2 of scale
    return []


SIZED = sorted(name for name, data in SEEDS.items() if size_fields(data))
EXTREMES = [0, 1, 2, 255, 256, 4095, 2**15 - 1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1]


@st.composite
def declared_sizes(draw: st.DrawFn) -> bytes:
    """A valid image whose header declares other sides (0, huge, negative for BMP, anything):
    a decoder must check them before it trusts them."""
    data = bytearray(SEEDS[draw(st.sampled_from(SIZED))])
    for offset, fmt in size_fields(bytes(data)):
        if draw(st.booleans()):
            limit = 256 ** struct.calcsize(fmt)
            value = draw(st.sampled_from(EXTREMES) | st.integers(0, limit - 1)) % limit
            if fmt.endswith("i") and value >= limit // 2:
                value -= limit
            struct.pack_into(fmt, data, offset, value)
    if data.startswith(b"\x89PNG"):  # a size behind a broken CRC would never be read
        struct.pack_into(">I", data, 29, zlib.crc32(data[12:29]))
    return bytes(data)


IMAGE_BYTES = st.one_of(
    st.binary(max_size=2048),
    st.builds(lambda magic, rest: magic + rest, st.sampled_from(MAGICS), st.binary(max_size=512)),
    mutated_images(),
    declared_sizes(),
)


# -- image bytes ----------------------------------------------------------------------------


def timed(call: Callable[[], Any]) -> Any:
    """``call()``; :class:`InvalidInput` comes back as the value; any other exception, or
    running past :data:`BOUND_S`, fails."""
    started = time.perf_counter()
    try:
        outcome = call()
    except InvalidInput as exc:
        outcome = exc
    elapsed = time.perf_counter() - started
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s"
    if isinstance(outcome, InvalidInput):
        assert isinstance(outcome.message, str)
        assert outcome.message
    return outcome


FIXED = Preprocess(image_size=16)
CROPPED = Preprocess(image_size=16, center_crop=True)


def check_image_bytes(data: bytes, max_pixels: int) -> None:
    """Every decoding entry point on ``data``: a typed refusal, or a sane result that agrees
    with the header's pixel count."""
    pixels = timed(lambda: image_pixels(data, max_pixels=max_pixels))
    if isinstance(pixels, int):
        assert 0 < pixels <= max_pixels
    for preprocess in (FIXED, CROPPED):
        tensor = timed(partial(decode_image, data, preprocess, max_pixels=max_pixels))
        if isinstance(tensor, torch.Tensor):
            assert isinstance(pixels, int), "decoded an image whose header was refused"
            assert tensor.shape == (3, 16, 16)
            assert tensor.dtype == torch.float32
            assert bool(torch.isfinite(tensor).all())
    image = timed(lambda: open_image(data, max_pixels=max_pixels))
    if isinstance(image, Image.Image):
        assert isinstance(pixels, int), "decoded an image whose header was refused"
        assert image.mode == "RGB"
        assert image.width * image.height == pixels  # EXIF rotation swaps the sides only


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_every_seed_decodes(name: str) -> None:
    """The mutations start from images that decode: a refusal below is the mutation's."""
    data = SEEDS[name]
    assert image_pixels(data, max_pixels=MAX_PIXELS) > 0
    assert decode_image(data, FIXED, max_pixels=MAX_PIXELS).shape == (3, 16, 16)
    assert open_image(data, max_pixels=MAX_PIXELS).mode == "RGB"


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_a_truncated_seed_is_refused_with_a_typed_error(name: str) -> None:
    """Cut anywhere, header included, each valid image is refused with InvalidInput, or
    decodes (a cut of trailing bytes no decoder needs)."""
    data = SEEDS[name]
    for cut in range(len(data)):
        check_image_bytes(data[:cut], MAX_PIXELS)


@NORMAL
@given(data=IMAGE_BYTES)
@example(data=b"")
@example(data=SEEDS["png"][:33])  # a header and nothing after it
def test_image_bytes_decode_or_give_a_typed_error_in_bounded_time(data: bytes) -> None:
    check_image_bytes(data, MAX_PIXELS)


@pytest.mark.hostile
@HOSTILE
@given(data=IMAGE_BYTES)
def test_image_bytes_decode_or_give_a_typed_error_in_bounded_time_hostile(data: bytes) -> None:
    check_image_bytes(data, EncoderSettings().max_image_pixels)


# -- mm_items strings -----------------------------------------------------------------------

PUBLIC = "93.184.216.34"
"""What a ``*.public.example`` name resolves to: a public address (never connected to)."""


class FakeResolver(trio.abc.HostnameResolver):
    """Names resolve without DNS: ``localhost`` to loopback, ``*.public.example`` to a public
    address, anything else is not found. Numeric hosts never reach here (Trio answers them
    itself), nor does what Trio cannot encode as a name."""

    async def getaddrinfo(
        self,
        host: bytes | None,
        port: bytes | str | int | None,
        family: int = 0,
        type: int = 0,
        proto: int = 0,
        flags: int = 0,
    ) -> list[Any]:
        name = (host or b"").decode("ascii").lower().rstrip(".")
        number = int(port) if isinstance(port, int | str) and str(port).isdigit() else 80
        if name == "localhost":
            address = "127.0.0.1"
        elif name.endswith("public.example"):
            address = PUBLIC
        else:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, number))]

    async def getnameinfo(self, sockaddr: Any, flags: int) -> tuple[str, str]:
        raise NotImplementedError


@dataclass
class Answer:
    """What the mock transport answers every request of one example with: a response, or
    (``fails``) one of httpx's transport errors, as a dead or misbehaving server gives."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    fails: str | None = None
    """The name of the httpx exception the request raises instead (``ConnectError``...)."""


@dataclass
class Network:
    """The mock transport's answer, set by each example."""

    reply: Answer = field(default_factory=Answer)

    def respond(self, request: httpx.Request) -> httpx.Response:
        reply = self.reply
        if reply.fails is not None:
            raise getattr(httpx, reply.fails)("the mock transport fails", request=request)
        # Headers as bytes and the body a stream, as off a socket (a server may send any
        # bytes in a header value; the fetcher reads the body raw, chunk by chunk).
        headers = [
            (name.encode(), value.encode("utf-8", "surrogatepass"))
            for name, value in reply.headers.items()
        ]
        return httpx.Response(reply.status, headers=headers, stream=httpx.ByteStream(reply.body))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A media directory holding one image, a file of another kind, and links out of it."""
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(SEEDS["png"])
    (root / "notes.txt").write_text("not an image")
    (root / "sub").mkdir()
    (root / "sub" / "b.jpg").write_bytes(SEEDS["jpeg"])
    (root / "out.png").symlink_to("/etc/passwd")
    (root / "loop.png").symlink_to(root / "loop.png")
    return root


@pytest.fixture(scope="module")
def offline() -> Iterator[Network]:
    """No network for the module: every ``httpx.AsyncClient`` the fetcher makes answers from
    the yielded :class:`Network` (whose reply each example sets)."""
    network = Network()
    real_client = httpx.AsyncClient
    transport = httpx.MockTransport(network.respond)

    def offline_client(**options: Any) -> httpx.AsyncClient:
        return real_client(transport=transport, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(httpx, "AsyncClient", offline_client)
        yield network


def load_one(item: str, media_dir: Path, network: Network, reply: Answer) -> None:
    """``load_items([item])`` with the network answering ``reply``: one image's bytes, or
    :class:`InvalidInput`, within the bound."""
    network.reply = reply
    encoder_settings = EncoderSettings(
        warmup=False,
        cache_bytes=0,
        max_image_pixels=MAX_PIXELS,
        max_image_bytes=1 << 16,
        media_dir=media_dir,
        remote_fetch=True,
        remote_private_networks=("127.0.0.0/8",),
        remote_timeout=2.0,
        remote_max_redirects=2,
    )

    async def run() -> list[bytes] | InvalidInput:
        trio.socket.set_custom_hostname_resolver(FakeResolver())
        encoder = ImageEncoder(FakeBackend(), encoder_settings, run_decode=inline)
        with trio.fail_after(BOUND_S):
            try:
                return await encoder.load_items([item])
            except InvalidInput as exc:
                return exc

    outcome = trio.run(run)
    if isinstance(outcome, InvalidInput):
        assert outcome.message.startswith("mm_items[0]: "), outcome.message
        return
    (data,) = outcome
    assert isinstance(data, bytes)
    assert image_pixels(data, max_pixels=MAX_PIXELS) > 0


ASCII = st.characters(min_codepoint=0, max_codepoint=127)
ANY_CHAR = st.characters(exclude_categories=())  # lone surrogates too
SEED_B64 = [base64.b64encode(data).decode() for data in SEEDS.values()]


@st.composite
def odd_base64(draw: st.DrawFn) -> str:
    """A seed's base64 with padding dropped or doubled, whitespace or ``=`` inside, the
    URL-safe alphabet, a stray character, cut short; or arbitrary text."""
    text = draw(st.sampled_from(SEED_B64))
    choice = draw(st.integers(0, 8))
    at = draw(st.integers(0, len(text)))
    if choice == 0:
        return text.rstrip("=")
    if choice == 1:
        return text + "=="
    if choice == 2:
        return (
            text[:at]
            + draw(st.sampled_from([" ", "\n", "\r\n", "\t", "=", "==", "%3D"]))
            + text[at:]
        )
    if choice == 3:
        return text.replace("+", "-").replace("/", "_")
    if choice == 4:
        return text[:at] + draw(st.text(ANY_CHAR, min_size=1, max_size=3)) + text[at:]
    if choice == 5:
        return text[:at]
    if choice == 6:
        return "=" * draw(st.integers(1, 8))
    if choice == 7:
        return base64.b64encode(draw(IMAGE_BYTES)).decode()
    return draw(st.text(ANY_CHAR, max_size=64))


MEDIA_TYPES = st.one_of(
    st.sampled_from(
        [
            *("image/png", "IMAGE/PNG", " image/jpeg ", "image/jpg", "image/webp", "image/gif"),
            *("image/bmp", "image/svg+xml", "image/tiff", "text/html", "", "image", "image/"),
        ]
    ),
    st.text(ANY_CHAR, max_size=12),
)
DATA_URIS = st.builds(
    lambda media, params, payload: f"data:{media}{params},{payload}",
    MEDIA_TYPES,
    st.sampled_from([";base64", ";BASE64", "; base64 ", ";charset=utf-8;base64", "", ";utf8", ";"]),
    odd_base64(),
) | st.builds(lambda rest: "data:" + rest, st.text(ANY_CHAR, max_size=64))

LABELS = st.one_of(
    st.sampled_from(["a", "images", "public", "example", "xn--", "xn--zz", "xn--55qx5d", "-a-"]),
    st.sampled_from(
        [
            "a_b",
            "%00",
            "%2e",
            "ß",
            "\uff4c\uff4f\uff43\uff41\uff4c",
            "\u200d",
            "٣",
            "",
            "a" * 63,
            "a" * 64,
        ]
    ),
    st.text(ASCII, max_size=8),
    st.text(ANY_CHAR, max_size=4),
)
NAMES = st.one_of(
    st.sampled_from(["localhost", "LOCALHOST.", "img.public.example", "a..public.example"]),
    st.builds(".".join, st.lists(LABELS, min_size=1, max_size=5)),
    st.builds(lambda labels: ".".join([*labels, "public.example"]), st.lists(LABELS, max_size=3)),
)
ADDRESSES = st.sampled_from(
    [
        *("127.0.0.1", "0.0.0.0", "10.0.0.1", "169.254.169.254", "2130706433", "127.1"),
        *("0177.0.0.1", "0x7f.1", "1.2.3.4.5", "[::1]", "[::ffff:127.0.0.1]", "[2002::1]"),
        *("[64:ff9b::a00:1]", "[fe80::1%25lo]", "[::1", "[v1.x]", PUBLIC, "256.0.0.1"),
        "[2606:2800:220:1::1]",
    ]
)
PORTS = st.one_of(
    st.just(""),
    st.builds(lambda n: f":{n}", st.integers(0, 70000)),
    st.builds(lambda n: f":{n}", st.integers(0, 10**30)),
    st.sampled_from([":", ":-1", ":+80", ":0x50", ":80 ", ":\uff11", ":99999999999999999999"]),
)
SCHEMES = st.sampled_from(["http", "https", "HTTP", "hTtPs", "ftp", "file", "gopher", "ws"])
URLS = st.builds(
    lambda scheme, userinfo, host, port, path: f"{scheme}://{userinfo}{host}{port}{path}",
    SCHEMES,
    st.sampled_from(["", "user@", "user:pass@", "@", "a@b@"]),
    NAMES | ADDRESSES,
    PORTS,
    st.one_of(
        st.sampled_from(["", "/", "/a.png", "/%zz", "/../../etc", "?#"]),
        st.text(ANY_CHAR, max_size=16),
    ),
)
PATHS = st.one_of(
    st.sampled_from(["a.png", "sub/b.jpg", "./a.png", "sub/../a.png", "notes.txt", "out.png"]),
    st.sampled_from(["loop.png", "missing.png", "../a.png", "/etc/passwd", "file:///etc/x.png"]),
    st.sampled_from(["file://a.png", "a.png\x00.png", "A.PNG", "sub", ".png", "a" * 300 + ".png"]),
    st.builds(
        lambda stem, suffix: stem + suffix,
        st.text(ANY_CHAR, max_size=24),
        st.sampled_from(["", ".png", ".JPG", ".gif"]),
    ),
)
REPLIES = st.one_of(
    st.builds(lambda body: Answer(200, {"Content-Type": "image/png"}, body), IMAGE_BYTES),
    st.builds(lambda: Answer(200, {}, b"")),
    st.builds(lambda: Answer(200, {"Content-Encoding": "gzip"}, SEEDS["png"])),
    st.builds(lambda: Answer(200, {"Content-Length": "999999999"}, SEEDS["png"])),
    st.builds(lambda status: Answer(status), st.sampled_from([204, 304, 404, 500, 999])),
    st.builds(
        lambda name: Answer(fails=name),
        st.sampled_from(["ConnectError", "ReadTimeout", "RemoteProtocolError", "ReadError"]),
    ),
    st.builds(
        lambda status, location: Answer(status, {"Location": location}),
        st.sampled_from([301, 302, 303, 307, 308]),
        URLS | st.text(ASCII, max_size=24),
    ),
)
ITEMS = st.one_of(DATA_URIS, URLS, PATHS, st.text(ANY_CHAR, max_size=64))


@NORMAL
@given(item=ITEMS, reply=REPLIES)
@example(item="data:image/png;base64," + SEED_B64[0], reply=Answer())
@example(item="http://img.public.example/a.png", reply=Answer(200, {}, SEEDS["png"]))
@example(item="http://img.public.example/a.png", reply=Answer(fails="ConnectError"))
@example(item="http://img.public.example/a.png", reply=Answer(302, {"Location": "http://[::1"}))
def test_any_item_string_loads_or_gives_a_typed_error(
    media_dir: Path, offline: Network, item: str, reply: Answer
) -> None:
    load_one(item, media_dir, offline, reply)


@pytest.mark.hostile
@HOSTILE
@given(item=ITEMS, reply=REPLIES)
def test_any_item_string_loads_or_gives_a_typed_error_hostile(
    media_dir: Path, offline: Network, item: str, reply: Answer
) -> None:
    load_one(item, media_dir, offline, reply)


def test_the_fake_network_serves_an_image_and_every_kind_of_item_loads(
    media_dir: Path, offline: Network
) -> None:
    """The rig itself: a URL, a data URI and a path each load the image they name."""

    async def run() -> list[bytes]:
        trio.socket.set_custom_hostname_resolver(FakeResolver())
        encoder = ImageEncoder(
            FakeBackend(),
            EncoderSettings(warmup=False, media_dir=media_dir, remote_fetch=True),
            run_decode=inline,
        )
        items = ["http://img.public.example/a.png", image_uri_of("jpeg"), "sub/b.jpg"]
        return await encoder.load_items(items)

    offline.reply = Answer(200, {}, SEEDS["gif"])
    assert trio.run(run) == [SEEDS["gif"], SEEDS["jpeg"], SEEDS["jpeg"]]


def image_uri_of(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode(SEEDS[name]).decode()


@pytest.mark.parametrize(
    ("url", "location"),
    [
        ("http://" + "a" * 64 + ".public.example/a.png", None),  # a label over 63 characters
        ("http://a..public.example/a.png", None),  # an empty label
        ("http://xn--/a.png", None),  # a punycode label with nothing encoded
        ("http://xn--zz.public.example/a.png", None),  # an invalid A-label
        ("http://127.0.0.1:" + "9" * 30 + "/a.png", None),  # a port past a C long
        ("http://img.public.example/a.png", "http://xn--/a.png"),  # redirected there
        ("http://img.public.example/a.png", "//a..public.example/a.png"),
    ],
)
def test_a_url_with_a_host_or_port_idna_or_getaddrinfo_rejects_is_invalid_input(
    media_dir: Path, offline: Network, url: str, location: str | None
) -> None:
    """Found by the property above: each was a 500 ``internal`` with a traceback in the
    server's log (UnicodeError or OverflowError out of httpx or getaddrinfo)."""
    redirect = Answer(302, {"Location": location}) if location is not None else None
    offline.reply = redirect or Answer(200, {}, SEEDS["png"])

    async def run() -> None:
        trio.socket.set_custom_hostname_resolver(FakeResolver())
        encoder = ImageEncoder(
            FakeBackend(), EncoderSettings(warmup=False, remote_fetch=True), run_decode=inline
        )
        with pytest.raises(InvalidInput, match=r"mm_items\[0\]: "):
            await encoder.load_items([url])

    trio.run(run)
