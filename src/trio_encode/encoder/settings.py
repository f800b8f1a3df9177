"""Every knob of the encoder in one frozen value, checked once when it is built.

Each field is declared with :func:`~trio_encode.declare.setting`, so it is also a flag of
``trio-encode serve``, a ``TRIO_ENCODE_*`` variable and a key of the config file, under the
same name.
"""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Annotated, Literal, Self, cast, get_args

from pydantic import AfterValidator, BeforeValidator, model_validator
from pydantic.dataclasses import dataclass

from trio_encode.declare import SETTINGS, comma_separated, in_group, secret_in_file
from trio_encode.sizes import ByteSize, GiB, MiB

DType = Literal["float32", "bfloat16", "float16"]
"""The dtypes a model runs in and its embeddings are sent as."""
DTypeChoice = Literal[DType, "auto"]


def _existing_dir(path: Path) -> Path:
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory")
    return path


ExistingDir = Annotated[Path, AfterValidator(_existing_dir)]

_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")


def _device(device: str) -> str:
    if _DEVICE.match(device) is None:
        raise ValueError(f"must be cpu or cuda:N, got {device!r}")
    return device


Device = Annotated[str, AfterValidator(_device)]


def _cidr(network: str) -> str:
    ipaddress.ip_network(network, strict=False)  # raises ValueError naming the bad one
    return network


def _master_address(address: str) -> str:
    """``HOST:PORT``, or ``etcd://HOST:PORT[;HOST:PORT...]`` for masters in HA mode."""
    endpoints = address.removeprefix("etcd://").split(";")
    for endpoint in endpoints:
        host, colon, port = endpoint.rpartition(":")
        if not (host and colon and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(
                f"must be HOST:PORT or etcd://HOST:PORT[;HOST:PORT...], got {address!r}"
            )
    return address


MasterAddress = Annotated[str, AfterValidator(_master_address)]
Names = Annotated[tuple[str, ...], BeforeValidator(comma_separated)]
Networks = Annotated[
    tuple[Annotated[str, AfterValidator(_cidr)], ...], BeforeValidator(comma_separated)
]


VIDEO_FPS, VIDEO_MIN_FRAMES, VIDEO_MAX_FRAMES = 2.0, 4, 768
"""SGLang's encoder's defaults for sampling a video's frames."""

VIDEO_MAX_SECONDS = 600.0
VIDEO_MAX_TOTAL_FRAMES = 36_000
VIDEO_MAX_FRAME_PIXELS = 3840 * 2160
VIDEO_MAX_PIXELS = 10_000_000_000
VIDEO_MAX_OUTPUT_BYTES = 1 * GiB
VIDEO_DECODE_CPU_SECONDS = 20.0
"""The defaults of the video limits (the ``video_max_*`` and ``video_decode_cpu_seconds``
settings, whose docstrings say why), which are also those of
:class:`~trio_encode.encoder.video.VideoLimits`."""

AUDIO_MAX_SECONDS = 600.0
AUDIO_MAX_OUTPUT_BYTES = 256 * MiB
AUDIO_DECODE_CPU_SECONDS = 30.0
"""The defaults of the audio limits (the ``audio_*`` settings, whose docstrings say why),
which are also those of :class:`~trio_encode.encoder.audio.AudioLimits`."""

model_setting = in_group("model")
batching_setting = in_group("batching")
cache_setting = in_group("cache")
server_setting = in_group("server")


@dataclass(frozen=True, config=SETTINGS)
class EncoderSettings:
    """Model shape, batching, cache and input limits.

    The defaults give a small built-in ViT (196 tokens of 2048 floats, 1.6 MB per image) that
    needs no download, so a fresh checkout can serve and be tested.
    """

    # The built-in model (refused when ``model`` is set: that directory's config decides).
    image_size: int = model_setting(224, gt=0)
    """Built-in ViT: side in pixels every image is resized to; a multiple of patch_size."""
    patch_size: int = model_setting(16, gt=0)
    """Built-in ViT: patch side; tokens per image = (image_size / patch_size)^2."""
    width: int = model_setting(384, gt=0)
    """Built-in ViT: transformer width (a multiple of heads)."""
    depth: int = model_setting(6, gt=0)
    """Built-in ViT: transformer layers."""
    heads: int = model_setting(6, gt=0)
    """Built-in ViT: attention heads."""
    mlp_ratio: float = model_setting(4.0, gt=0)
    """Built-in ViT: MLP width as a multiple of width."""
    hidden_size: int = model_setting(2048, gt=0)
    """Built-in ViT: the language model's hidden size, the width of every embedding row sent to
    prefill ranks (the projector's output). A model directory's config gives its own."""
    dtype: DTypeChoice = model_setting("auto")
    """Dtype of the model and of the embeddings sent; bfloat16 or float16 halve the bytes moved.
    auto: a model directory's own (its config's torch_dtype, as SGLang's --dtype auto), float32
    for the built-in ViT or a config that names none."""
    device: Device = model_setting("cpu")
    """Where the forward runs: cpu or cuda:N. On CUDA the embeddings are copied into the arena
    (pinned host memory) asynchronously, and the copy completes before any send reads them."""
    seed: int = model_setting(0)
    """Built-in ViT: seed its random weights are drawn from (unless weights is given); servers with
    the same seed produce the same embeddings."""
    weights: Path | None = model_setting(None)
    """Built-in ViT: a safetensors file of its weights (saved by
    trio_encode.encoder.model.save_weights) instead of seeded random ones."""

    # A real model instead of the built-in one.
    model: ExistingDir | None = model_setting(None)
    """Serve a Hugging Face model from this local directory (config, safetensors, processor files;
    nothing is downloaded) instead of the built-in ViT: a VLM's vision tower and projector
    (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA 1.5, LLaVA-OneVision, Gemma 3, InternVL), or a bare
    CLIP/SigLIP tower. Needs the 'hf' extra."""
    feature_layer: int = model_setting(-1)
    """With a CLIP/SigLIP tower as model: hidden layer whose states are returned (-1 the last). A
    VLM's config names its own."""
    video_fps: float = model_setting(VIDEO_FPS, gt=0)
    """Video frames taken per second of video, for a model with a video path (SGLang's video
    fps: set it equal to the SGLang deployment's)."""
    video_min_frames: int = model_setting(VIDEO_MIN_FRAMES, gt=0)
    """At least this many frames of a video (rounded up to a whole temporal patch), if it has
    them (SGLang's min_frames)."""
    video_max_frames: int = model_setting(VIDEO_MAX_FRAMES, gt=0)
    """At most this many frames of a video (SGLang's max_frames)."""

    # Batching.
    max_batch_size: int = batching_setting(8, gt=0)
    """Images per forward pass, gathered across concurrent requests."""
    max_batch_tokens: int | None = batching_setting(None, gt=0)
    """Image tokens per forward pass (the sum of its images' embedding rows); a forward holds at
    least one image whatever its size. Default: only max_batch_size bounds a forward."""
    max_batch_wait: float = batching_setting(0.005, ge=0)
    """Seconds the oldest queued image may wait for others to fill its batch: latency traded for
    throughput."""
    queue_size: int = batching_setting(64, gt=0)
    """Images that may wait for (or be decoded for) a forward pass; more get 503, so a burst is
    refused quickly instead of timing out. Also the most images per request (checked before any is
    loaded)."""
    torch_threads: int | None = batching_setting(None, gt=0)
    """torch.set_num_threads for the forward pass (default: torch's own, one per core). Lower it to
    leave cores to image decoding and the event loop."""
    media_decode_threads: int = batching_setting(1, gt=0)
    """Threads that decode videos and audio clips, apart from the two that load and decode
    images, so an image never waits behind a video; clips beyond it wait their turn (a video its
    container's header refuses is answered at once). Each holds up to the peak
    video_max_output_bytes gives, so this bounds the server's memory for videos too."""
    warmup: bool = batching_setting(True)
    """Run one forward before reporting ready, so the first request pays no start-up cost."""

    # Cache.
    cache_bytes: ByteSize = cache_setting(256 * MiB, ge=0)
    """Embeddings kept for repeated images (keyed by content); 0 disables the cache. With an arena,
    the cache lives in it and this bounds the bytes it may keep."""
    arena_bytes: ByteSize = cache_setting(512 * MiB, ge=0)
    """The registered arena embeddings are written into, registered once for the process's life so
    sends register nothing; 0 turns it off (each request registers its own embedding). Pages are
    touched only as segments are written; over RDMA the whole arena is pinned."""

    # The cluster-wide second level (Mooncake Store).
    store_master: MasterAddress | None = cache_setting(None)
    """HOST:PORT of a mooncake_master (or etcd://HOST:PORT;... for masters in HA mode): share
    embeddings with every encoder of the cluster through Mooncake Store, looked up after this
    server's own cache; a slow or failed store only costs a local forward."""
    store_segment_bytes: ByteSize = cache_setting(512 * MiB, gt=0)
    """With store_master: memory lent to the store."""
    store_buffer_bytes: ByteSize = cache_setting(64 * MiB, gt=0)
    """With store_master: the store client's local transfer buffer."""
    store_wait: float = cache_setting(0.2, gt=0)
    """With store_master: seconds a request waits for a store lookup before it runs the forward
    itself."""
    store_key_file: Path | None = cache_setting(None)
    """With store_master: a file whose first line is a secret every encoder of the fleet shares.
    Each store entry then carries a keyed digest of its name and bytes, so only holders of the
    secret can write entries the fleet serves; without it, whoever reaches the store's ports can
    (firewall them)."""

    # Input limits.
    max_image_bytes: ByteSize = server_setting(20 * MiB, gt=0)
    """Encoded size of one image; larger ones get 400."""
    max_image_pixels: int = server_setting(40_000_000, gt=0)
    """Width x height of one image, checked before decoding (decompression bombs); larger ones get
    400."""
    max_request_bytes: ByteSize = server_setting(64 * MiB, gt=0)
    """Encoded bytes of all of one request's images together (inline, files and fetches), counted as
    they are loaded: the rest is never read or fetched."""
    max_request_pixels: int = server_setting(100_000_000, gt=0)
    """Width x height of all of one request's images together, read from their headers before any is
    decoded, so one request cannot hold the decode threads for long."""
    video_max_seconds: float = server_setting(VIDEO_MAX_SECONDS, gt=0)
    """Duration of one video, declared by its container or spanned by its packets' timestamps;
    longer ones get 413. Ten minutes: SGLang's sampling (2 frames a second, at most 768) stops
    adding frames after 384 s, so a longer video only costs more to read."""
    video_max_total_frames: int = server_setting(VIDEO_MAX_TOTAL_FRAMES, gt=0)
    """Frames of one video's stream (SGLang's total_num_frames), declared or counted from its
    packets; more get 413. Ten minutes at 60 frames a second. (video_max_frames is how many of
    them the model sees.) Also the samples any track of an MP4 may declare, checked before
    FFmpeg opens the file, as FFmpeg indexes every one."""
    video_max_frame_pixels: int = server_setting(VIDEO_MAX_FRAME_PIXELS, gt=0)
    """Width x height of a video's frames (4K UHD), declared or decoded; a frame of another size
    than declared is refused too (413)."""
    video_max_pixels: int = server_setting(VIDEO_MAX_PIXELS, gt=0)
    """Frames x frame pixels of one video's whole stream, declared or counted (413 beyond): the
    decoder's work when keyframes are far apart, as every frame from a keyframe to a chosen one
    is decoded. About what one core decodes of H.264 within video_decode_cpu_seconds (500
    million pixels a second): 160 s of 1080p at 30 frames a second, ten minutes of 540p."""
    video_max_output_bytes: ByteSize = server_setting(VIDEO_MAX_OUTPUT_BYTES, gt=0)
    """The decoded frames SGLang's sampling chooses from one video, as RGB at the video's own
    size (frames x width x height x 3), checked before any frame is decoded (413 beyond). The
    768 frames of a 480p video, or 172 frames (86 s at 2 a second) of 1080p; the model sees
    them shrunk to 90 million pixels or fewer, but they are decoded whole first: a video's
    decode peaks at about twice its frames' bytes (they are resized eight at a time in
    float32), plus the model's input (at most 90 million pixels in float32, about 1 GiB)."""
    video_decode_cpu_seconds: float = server_setting(VIDEO_DECODE_CPU_SECONDS, gt=0)
    """CPU seconds one video's decode may take (reading its packets and decoding its frames,
    counted on its own thread); it is stopped at the next packet or frame past it (413). With
    one video decode thread, this is also what a video may keep the next one waiting."""
    audio_max_seconds: float = server_setting(AUDIO_MAX_SECONDS, gt=0)
    """Duration of one audio clip, declared by its container or decoded; longer ones get 413.
    Ten minutes: far more than the audio models served take in one clip (Qwen2-Audio's window
    is 30 s, and a longer clip is refused by its model anyway)."""
    audio_max_output_bytes: ByteSize = server_setting(AUDIO_MAX_OUTPUT_BYTES, gt=0)
    """Bytes of one clip's decoded samples (mono float32 at the model's rate), checked from its
    header before decoding and as the samples come (413 beyond): what a clip whose header lies
    can make the server hold. Ten minutes at 48 kHz are 115 MB."""
    audio_decode_cpu_seconds: float = server_setting(AUDIO_DECODE_CPU_SECONDS, gt=0)
    """CPU seconds one clip's decode may take (counted on its own thread); it is stopped at the
    next packet past it (413)."""
    media_dir: ExistingDir | None = server_setting(None)
    """Also accept mm_items that are paths of image files inside this directory (and nowhere
    else)."""

    # Remote images (``http(s)://`` items), fetched under these rules; see encoder/fetch.py.
    remote_fetch: bool = server_setting(False)
    """Fetch http(s):// items in mm_items; off by default, so clients cannot make the server connect
    anywhere."""
    remote_hosts: Names = server_setting(())
    """With remote_fetch: when set, the only host names that may be fetched (comma-separated)."""
    remote_private_networks: Networks = server_setting(())
    """With remote_fetch: CIDR networks outside the public internet (private, loopback, link-local)
    that fetches may still reach; every other non-public address is refused."""
    remote_timeout: float = server_setting(10.0, gt=0)
    """Seconds one item's fetch may take, redirects included."""
    remote_max_redirects: int = server_setting(3, ge=0)
    """Redirects one fetch may follow (each hop is checked like the first URL)."""

    @model_validator(mode="after")
    def _flags_apply(self) -> Self:
        """A setting the configured model does not use is refused, never silently ignored."""
        builtin_only = (
            "image_size",
            "patch_size",
            "width",
            "depth",
            "heads",
            "mlp_ratio",
            "hidden_size",
            "seed",
            "weights",
        )
        if self.model is not None:
            given = [name for name in builtin_only if _differs(self, name)]
            if given:
                raise ValueError(
                    f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to the "
                    f"built-in ViT, not to model {self.model}, whose config decides (drop "
                    f"{'it' if len(given) == 1 else 'them'})"
                )
        elif _differs(self, "feature_layer"):
            raise ValueError("feature_layer only applies with model (a CLIP/SigLIP tower)")
        return self

    @model_validator(mode="after")
    def _store_key_from_file(self) -> Self:
        """Read once, at start, so a bad file is refused before anything runs; kept off the
        fields, so the secret is in no repr, flag, variable or log line."""
        secret = None
        if self.store_key_file is not None:
            secret = secret_in_file(self.store_key_file, "store_key_file").encode()
        object.__setattr__(self, "_store_secret", secret)  # frozen: set once, here
        return self

    @property
    def model_dtype(self) -> DType:
        """The dtype the model runs in: ``dtype``, with ``auto`` resolved (reads the model
        directory's ``config.json``; a :class:`ValueError` names a dtype it cannot serve)."""
        if self.dtype != "auto":
            return self.dtype
        if self.model is None:
            return "float32"
        return config_dtype(self.model / "config.json")

    @property
    def store_secret(self) -> bytes | None:
        """The fleet's secret read from ``store_key_file``, or None without one."""
        secret: bytes | None = self.__dict__["_store_secret"]
        return secret

    @model_validator(mode="after")
    def _shapes_fit(self) -> Self:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        return self


def config_dtype(path: Path) -> DType:
    """The dtype a model's ``config.json`` names (``dtype``, or ``torch_dtype`` as older
    transformers write it; a VLM's may only be in its ``text_config``); float32 if none,
    which is what transformers loads such a model in."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    for place in (config, config.get("text_config")):
        if not isinstance(place, dict):
            continue
        named = place.get("dtype") or place.get("torch_dtype")
        if named is None:
            continue
        name = str(named).removeprefix("torch.")
        if name not in get_args(DType):
            raise ValueError(
                f"{path} names dtype {name!r}, which is not served (with dtype auto); "
                f"choose one with dtype: {', '.join(get_args(DType))}"
            )
        return cast(DType, name)
    return "float32"


def _differs(settings: EncoderSettings, name: str) -> bool:
    """Whether a field holds other than its default (a value someone chose)."""
    default = EncoderSettings.__pydantic_fields__[name].default  # type: ignore[attr-defined]
    return bool(getattr(settings, name) != default)
