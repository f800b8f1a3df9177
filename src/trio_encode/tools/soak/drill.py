"""What a fault drill needs to act as prefill ranks against a server it only sees over HTTP.

- :class:`CheckedImages`: images, and the digest of each one's embedding as the model computes it
  alone (one image, no server, no batching), so every landed byte can be checked;
- :class:`Rank`: a receiver process carved into fixed slots. A slot whose send answered 200 is
  checked and filled with a marker, and before it is handed out again it must still hold that
  marker: a write that lands after its 200 (a transfer the server let outlive its answer) shows.
  A slot whose send failed rests longer (bytes of that request may still land), then is filled
  with the marker too; whoever uses it next checks first that it still holds only the marker
  (:meth:`Rank.clean`): a byte that lands later belongs to no request of that slot's. With
  stamped embeddings (:mod:`trio_encode.testing.identity`) every check reads the slot word by
  word, and a wrong byte names the image (so the request) and the offset it came from;
- :class:`Call` and :func:`post`: one HTTP answer, with the facts the checks need.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from trio_encode.encoder import EncoderSettings
from trio_encode.testing.identity import SlotReading, tag
from trio_encode.tools.soak.receiver import ReceiverGone, ReceiverProcess

_ENGINE_CODE = re.compile(r"failed with code (-?\d+)")


@dataclass(frozen=True)
class CheckedImages:
    """Distinct images as data URIs, and the xxh3-64 digest of each one's embedding."""

    items: tuple[str, ...]
    digests: tuple[int, ...]
    bytes_per_image: int

    @classmethod
    def build(cls, settings: EncoderSettings, count: int, seed: int = 0) -> CheckedImages:
        """``count`` natural-looking JPEGs for the model ``settings`` name. Blocking: loads
        the model and runs it once per image."""
        import base64

        import torch
        import xxhash

        from trio_encode.encoder import load_backend  # torch: not for --help
        from trio_encode.testing.images import natural_jpegs

        model = load_backend(settings)
        jpegs = natural_jpegs(count, settings.image_size, seed)
        digests = []
        nbytes = 0
        for jpeg in jpegs:
            image = model.decode(jpeg, max_pixels=settings.max_image_pixels)
            with torch.inference_mode():
                row = model.encode([image])[0].to("cpu").contiguous()
            raw = row.view(torch.uint8).flatten().numpy()
            nbytes = raw.nbytes
            digests.append(xxhash.xxh3_64_intdigest(raw.data))
        items = tuple("data:image/jpeg;base64," + base64.b64encode(j).decode() for j in jpegs)
        return cls(items, tuple(digests), nbytes)


@dataclass(frozen=True)
class TaggedImages:
    """Photo-like JPEGs that a drill tags with identities
    (:func:`~trio_encode.testing.identity.tag`), and the bytes of one image's embedding. A
    server run with ``--stamp-embeddings`` answers a tagged image with an embedding that names
    its identity in every word, so what must land is known without running the model."""

    jpegs: tuple[bytes, ...]
    bytes_per_image: int

    @classmethod
    def build(cls, settings: EncoderSettings, count: int, seed: int = 0) -> TaggedImages:
        """``count`` JPEGs for the model ``settings`` name. Blocking: loads the model and runs
        it once, for the size of an embedding."""
        import torch

        from trio_encode.encoder import load_backend  # torch: not for --help
        from trio_encode.testing.images import natural_jpegs

        model = load_backend(settings)
        jpegs = tuple(natural_jpegs(count, settings.image_size, seed))
        image = model.decode(jpegs[0], max_pixels=settings.max_image_pixels)
        with torch.inference_mode():
            nbytes = model.encode([image])[0].numel() * model.dtype.itemsize
        return cls(jpegs, nbytes)

    def item(self, photo: int, identity: int) -> str:
        """Photo ``photo`` tagged with ``identity``, as a data URI."""
        import base64

        data = tag(self.jpegs[photo], identity)
        return "data:image/jpeg;base64," + base64.b64encode(data).decode()


@dataclass(frozen=True)
class Call:
    """One HTTP answer (or the lack of one) as a drill saw it."""

    route: str
    req_id: str
    rank: str
    status: int
    """0: no answer (the client went away, or the connection broke)."""
    seconds: float
    started: float
    """``time.monotonic()`` when the call began."""
    code: int | None = None
    """The engine's return code named by a 502."""
    shape_ok: bool = True
    """Whether an error answer had the contract's shape."""
    message: str = ""


async def post(
    http: httpx.AsyncClient, route: str, body: dict[str, Any], *, rank: str
) -> tuple[Call, dict[str, Any]]:
    """POST ``body``; the call's record and the answer's JSON (empty if there was none)."""
    started = time.monotonic()
    req_id = str(body.get("req_id"))
    try:
        response = await http.post(route, json=body)
    except httpx.TransportError as exc:
        return Call(
            route, req_id, rank, 0, time.monotonic() - started, started, message=str(exc)
        ), {}
    seconds = time.monotonic() - started
    try:
        data = response.json()
    except json.JSONDecodeError:
        data = None
    status = response.status_code
    if status == 200 and isinstance(data, dict):
        return Call(route, req_id, rank, status, seconds, started), data
    shaped = (
        isinstance(data, dict)
        and data.get("status") == "error"
        and isinstance(data.get("message"), str)
        and data.get("req_id") in (req_id, None)
    )
    message = str(data.get("message")) if isinstance(data, dict) else response.text[:200]
    match = _ENGINE_CODE.search(message) if status == 502 else None
    code = int(match[1]) if match else None
    call = Call(route, req_id, rank, status, seconds, started, code, shaped, message)
    return call, data if isinstance(data, dict) else {}


@dataclass(eq=False)
class Slot:
    rank: Rank
    offset: int
    dirty: bool = False
    """Its last send did not answer 200: bytes may still land, so it is not checked."""
    identities: tuple[int, ...] = ()
    """The stamped images its last request sent into it: their bytes landing later are that
    request's (late), not another's (foreign)."""

    @property
    def nbytes(self) -> int:
        return self.rank.slot_bytes

    @property
    def address(self) -> int:
        return self.rank.receiver.address + self.offset


@dataclass(eq=False)
class Rank:
    """One receiver process and its pool, cut into slots of ``images_per_slot`` embeddings."""

    receiver: ReceiverProcess
    part_bytes: int
    """Bytes of one image's embedding."""
    images_per_slot: int = 1
    """The most images one request sends into a slot."""
    quiet_seconds: float = 0.2
    """How long a checked slot rests before its marker is checked and it is reused."""
    dirty_seconds: float = 10.0
    """How long a slot whose send failed rests (a transfer may still be running into it)."""
    late_writes: list[str] = field(default_factory=list)
    """The req_ids whose slot was written after their send answered 200 (and what landed)."""
    foreign_after: list[SlotReading] = field(default_factory=list)
    """Readings of slots found written, after their 200, with another request's bytes."""
    calls_while_frozen: bool = False
    """Its HTTP calls go on while its receiver is frozen (a peer frozen at first contact);
    otherwise a frozen rank makes no calls."""
    _free: list[Slot] = field(default_factory=list)
    _returned: trio.Event = field(default_factory=trio.Event)
    _checked: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        count = self.receiver.nbytes // self.slot_bytes
        if count < 1:
            raise ValueError("the receiver's pool is smaller than one slot")
        self._free = [Slot(self, i * self.slot_bytes) for i in range(count)]

    @property
    def slot_bytes(self) -> int:
        return self.images_per_slot * self.part_bytes

    @property
    def name(self) -> str:
        return self.receiver.name

    @property
    def session_id(self) -> str:
        return self.receiver.session_id

    @asynccontextmanager
    async def slot(self, nursery: trio.Nursery) -> AsyncIterator[Slot]:
        """A free slot for one request; on exit it rests (a task in ``nursery``) and is
        checked for late writes before it is free again."""
        while not self._free:
            if not self.receiver.alive:
                raise ReceiverGone(f"receiver {self.name} is gone")
            await self._returned.wait()
        slot = self._free.pop()
        try:
            yield slot
        finally:
            nursery.start_soon(self._rest, slot)

    def kill(self) -> None:
        """SIGKILL the receiver; whoever waits for one of its slots gets ReceiverGone."""
        self.receiver.kill()
        self._returned.set()

    async def check(self, slot: Slot, req_id: str, digests: Sequence[int]) -> bool:
        """Whether the slot holds these images' embeddings, in order; it is then marked."""
        results = await self.receiver.check(
            slot.offset, self.part_bytes, list(digests), slot.nbytes
        )
        self._checked[slot.offset] = req_id
        return all(results)

    async def verify(self, slot: Slot, req_id: str, identities: Sequence[int]) -> SlotReading:
        """What the slot holds, these stamped images expected in order (the rest blank); it
        is then marked."""
        slot.identities = tuple(identities)
        reading = await self.receiver.verify(
            slot.offset, slot.nbytes, self.part_bytes, list(identities)
        )
        self._checked[slot.offset] = req_id
        return reading

    async def clean(self, slot: Slot, own: Sequence[int] = ()) -> SlotReading:
        """What a slot holds besides the marker (or the zeros of a slot never used): bytes of
        the stamped images ``own`` (late), of any other (foreign), or corruption. About to be
        used, its last request's bytes are another request's too."""
        return await self.receiver.read(slot.offset, slot.nbytes, self.part_bytes, list(own))

    async def _rest(self, slot: Slot) -> None:
        # Cancelled (the drill is over), a resting slot is simply not handed out again.
        await trio.sleep(self.dirty_seconds if slot.dirty else self.quiet_seconds)
        checked_by = self._checked.pop(slot.offset, None)
        with trio.CancelScope(shield=True):
            try:
                if checked_by is not None and not slot.dirty:
                    reading = await self.clean(slot, slot.identities)
                    if reading.foreign:
                        self.foreign_after.append(reading)
                    if not reading.clean:
                        self.late_writes.append(f"{checked_by} ({describe(reading)})")
                await self.receiver.fill(slot.offset, slot.nbytes)
            except ReceiverGone:
                self._returned.set()  # wake whoever waits for a slot: there will be none
                return
            slot.dirty = False
            self._free.append(slot)
            self._returned.set()
            self._returned = trio.Event()


def describe(reading: SlotReading, owner: Callable[[int], str] = str) -> str:
    """A reading's wrong bytes in words: whose (``owner`` names an identity) and where."""
    parts = [
        f"{f.nbytes} bytes of {owner(f.identity)} (its byte {f.word * 8} on) at slot offset "
        f"{f.offset}"
        for f in reading.foreign
    ]
    if reading.own_late:
        parts.append(f"{reading.own_late} bytes of its own request")
    if reading.missing:
        parts.append(f"{reading.missing} bytes never written")
    if reading.corrupt:
        parts.append(f"{reading.corrupt} bytes of no request (corrupt)")
    return "; ".join(parts) or "nothing wrong"
