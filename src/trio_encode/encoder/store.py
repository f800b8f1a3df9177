"""The second cache level: embeddings in Mooncake Store, shared by every encoder of a cluster.

The keeper (:mod:`trio_encode.encoder.keeping`) looks an image up in this encoder's arena or
cache, then here, and only then is the forward run; after a forward it offers the embedding
here, so the next encoder asked for that image (a sibling that failed over, an encoder that
joined, an image routed elsewhere) skips the forward.

Keys are ``trio-encode/checked/v2/<model fingerprint>/<modality>/<recipe>/<sha256 of the
item's bytes>`` (:func:`store_key`; :mod:`trio_encode.encoder.fingerprint`): encoders with
different models or dtypes, items sent as different modalities, and videos sampled otherwise
never share an entry; the same model and settings on every host always do.

An entry is one object, written by one put from three buffers: the 8-byte XXH3-64 digest of the
row (the digest recorded when the forward wrote the row, never recomputed from bytes that may
have changed since), the row's description (``_HEADER`` bytes: its grid and the metadata
SGLang's prefill reads beside it, with a tag over them, the entry's name and that digest),
then the row. Every read compares the row it got with the digest it got with it, and the
description with its tag, in the reading thread, before either is used: an entry whose parts
disagree (written into through the store's own transfer port, torn, or raced) is a
``poisoned`` lookup, removed from the store and encoded again, never served. The layout and
the key scheme are versioned together (``_FORMAT``, in every name): entries of another version
are misses, never misread.

That digest is not a secret: whoever can put to the store can write a consistent entry of their
own. With a fleet secret (``store_key_file``) the digest is a MAC instead, over the entry's
name and row, and so is the description's tag (``_Seal``), under a prefix of that secret's
own: an entry is served only if a holder of the secret wrote that row and description under
that name; anything else found there (a stranger's, one sealed without the secret or under
another, a valid entry copied from another image's name) is poisoned. Without a secret the
store's network must be closed to strangers (``docs/operations.md``).

The store must never fail or slow a request:

- a lookup waits at most ``store_wait`` seconds (for a worker thread and the reads together),
  then the request runs the forward as if the store had missed. A Mooncake call cannot be
  interrupted, so a lookup that runs late is abandoned, not awaited: its thread holds its own
  reference to the memory it writes, and that memory is never used for anything else;
- puts run in the background, off the request's path, from a bounded queue (when it is full,
  the put is dropped). A put reads its tensor when it runs, long after the forward that wrote
  it, and an abandoned put may read it later still: the caller says what to give back once the
  put no longer reads it (``done``: the keeper's lease on an arena segment), and the store
  calls it only when the put has finished, failed, or was dropped, never at a timeout;
- the connection to the master is made in the background too; until it is up, lookups report
  ``unavailable`` at once;
- every outcome is counted (:class:`StoreObserver`), so a store that misbehaves shows in the
  metrics instead of in latency.

A hit's row is written straight into the tensor the request will send from (over TCP
any memory works; over RDMA that memory must be registered with the store's client, which is
what a registered arena provides).
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import json
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import trio
import xxhash

from trio_encode.embedding import CHECKSUM_ALGORITHM, tensor_checksum
from trio_encode.encoder.backend import ItemMeta
from trio_encode.encoder.cache import CacheKey
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.request_types import Grid

log = logging.getLogger(__name__)

LookupResult = Literal["hit", "miss", "error", "timeout", "unavailable", "poisoned"]
PutResult = Literal["stored", "failed", "timeout", "dropped"]

_OBJECT_NOT_FOUND = -704  # Mooncake Store's code for a key it does not hold
_POISONED = 1  # not a Mooncake code: an entry read whole whose row and digest disagree
_CHANGED = 2  # not a Mooncake code: a row to seal no longer matches its recorded checksum
_PUT_QUEUE = 64  # embeddings waiting to be put; more are dropped
_PUT_SECONDS = 5.0  # one put's bound; a slower one is abandoned and counted as a timeout
_THREADS = 4  # store calls in flight, abandoned ones included: a hung store holds at most this
_RETRY_SECONDS = 5.0  # between attempts to reach the master
_WARN_SECONDS = 10.0  # a failing store logs at most one line per period; metrics count all
_DIGEST = 8  # bytes of the digest (XXH3-64, or the keyed MAC) in front of each entry's row
_HEADER = 1024  # bytes of each entry's description, between its digest and its row
_LENGTH = 2  # bytes of the description's length, after its tag
_FORMAT = "v2"  # the entries' layout and names: digest, description, row
_PREFIX = f"trio-encode/checked/{_FORMAT}/"  # entries of this layout without a secret


def store_key(fingerprint: str, key: CacheKey) -> str:
    """The store's key for an item's embedding under the model ``fingerprint``: everything in
    its :class:`CacheKey` but the model's id, which the fingerprint stands for
    (:meth:`MooncakeEmbeddingStore.entry_name` moves it under a fleet secret's own prefix)."""
    return f"{_PREFIX}{fingerprint}/{key.modality}/{key.recipe or '-'}/{key.sha256}"


@dataclass(frozen=True)
class StoreHit:
    """An entry found and checked: its row's checksum and what was stored beside the row."""

    checksum: str
    grid: Grid | None = None
    meta: ItemMeta = ()


class _Seal:
    """The keyed digest in front of an entry's row under a fleet secret: HMAC-SHA256 over the
    entry's name and its row, cut to the 8 bytes the layout has room for (a forger gets one
    guess per lookup of the fleet, each right with odds of 2**-64). HMAC-SHA256 rather than
    keyed BLAKE2b: with the CPU's SHA instructions it took half the time on a 1.6 MB row.

    The name is sealed with the row, so a valid entry copied under another image's name does
    not open. Entries sealed under a secret live under a prefix of that secret's own (an id
    derived one-way from it): a fleet that turns a secret on, or changes it, finds the other
    entries missing, not poisoned, so ``poisoned`` keeps meaning "someone forged or damaged an
    entry" instead of counting every old entry during a roll-out, and old entries age out.
    """

    def __init__(self, secret: bytes) -> None:
        self._key = hmac.digest(secret, b"trio-encode store seal", "sha256")
        key_id = hmac.digest(secret, b"trio-encode store key id", "sha256")[:4].hex()
        self.prefix = f"trio-encode/keyed/{_FORMAT}/{key_id}/"

    def __repr__(self) -> str:
        return f"_Seal({self.prefix!r})"  # never the key

    def digest(self, name: str, row: torch.Tensor) -> bytes:
        mac = hmac.new(self._key, name.encode() + b"\0", "sha256")
        mac.update(row.view(torch.uint8).numpy().data)  # hashlib lets go of the GIL for it
        return mac.digest()[:_DIGEST]

    def tag(self, text: bytes) -> bytes:
        """The keyed tag of an entry's description (``text``: see :func:`_tag`)."""
        return hmac.digest(self._key, b"description\0" + text, "sha256")[:_DIGEST]


def _tag(seal: _Seal | None, name: str, front: bytes, body: bytes) -> bytes:
    """The tag of an entry's description: over the entry's name, the digest in front of its
    row (so a description is good only beside that digest, which is good only beside that
    row) and the description's body; keyed under a fleet secret, XXH3-64 without one."""
    text = name.encode() + b"\0" + front + body
    return xxhash.xxh3_64_digest(text) if seal is None else seal.tag(text)


def _body(grid: Grid | None, meta: ItemMeta) -> bytes | None:
    """A row's grid and metadata as its description holds them: the length, then JSON; None
    when they do not fit."""
    text = json.dumps({"grid": grid, "meta": meta}, separators=(",", ":")).encode()
    if len(text) > _HEADER - _DIGEST - _LENGTH:
        return None
    return len(text).to_bytes(_LENGTH, "little") + text


def _describe(seal: _Seal | None, name: str, front: bytes, body: bytes) -> bytes:
    """A row's description as stored between the digest in front of it (``front``) and
    itself: the tag, the body (:func:`_body`), zeros to ``_HEADER`` bytes."""
    return (_tag(seal, name, front, body) + body).ljust(_HEADER, b"\0")


def _described(
    seal: _Seal | None, name: str, front: bytes, checksum: str, header: bytes
) -> StoreHit | None:
    """The hit an entry makes of its row (of ``checksum``, already checked against ``front``)
    and its description; None when the description is not the one written beside that digest
    under that name, or not one at all."""
    length = int.from_bytes(header[_DIGEST : _DIGEST + _LENGTH], "little")
    body = header[_DIGEST : _DIGEST + _LENGTH + length]
    if not hmac.compare_digest(_tag(seal, name, front, body), header[:_DIGEST]):
        return None
    try:
        fields = json.loads(body[_LENGTH:])
        grid = fields["grid"]
        meta = tuple(
            (str(n), v if isinstance(v, int | float) else list(v)) for n, v in fields["meta"]
        )
        return StoreHit(checksum, None if grid is None else tuple(int(n) for n in grid), meta)
    except (ValueError, TypeError, KeyError):
        return None  # tagged, so written with this tag's key: by a broken or foreign writer


def _digest_bytes(checksum: str) -> torch.Tensor:
    """An ``xxh3-64:<hex>`` checksum as the 8 bytes stored in front of a row."""
    algorithm, _, hexdigest = checksum.partition(":")
    if algorithm != CHECKSUM_ALGORITHM or len(hexdigest) != 2 * _DIGEST:
        raise ValueError(f"not an {CHECKSUM_ALGORITHM} checksum: {checksum!r}")
    return torch.frombuffer(bytearray.fromhex(hexdigest), dtype=torch.uint8)


def _stored_checksum(digest: torch.Tensor) -> str:
    return f"{CHECKSUM_ALGORITHM}:{bytes(digest.numpy()).hex()}"


Done = Callable[[], None]
"""What a put calls once it no longer reads its tensor (on the event loop, exactly once)."""


class StoreObserver(Protocol):
    """Receives the store's events; the server's metrics implement it. Called on the event
    loop; implementations must be quick."""

    def store_connected(self, connected: bool) -> None: ...

    def store_looked_up(self, result: LookupResult, images: int) -> None: ...

    def store_put(self, result: PutResult) -> None: ...


class NullStoreObserver:
    def store_connected(self, connected: bool) -> None:
        pass

    def store_looked_up(self, result: LookupResult, images: int) -> None:
        pass

    def store_put(self, result: PutResult) -> None:
        pass


class EmbeddingStore(Protocol):
    """The second cache level as the encoder uses it."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect and serve puts until cancelled (started in the encoder's nursery). Never
        raises an :class:`Exception`: a broken store leaves the encoder without it."""
        ...

    async def get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[StoreHit | None]:
        """Fill ``into[i]`` with the embedding stored under ``keys[i]``; for each, its checksum,
        grid and metadata if it was found and its bytes and description match what was stored
        with them, else None.

        Never raises for the store's sake and returns within the configured wait. A tensor
        that was not found may still be written afterwards (an abandoned read): the caller
        must drop it, never reuse its memory.
        """
        ...

    def put(
        self,
        key: str,
        tensor: torch.Tensor,
        checksum: str,
        done: Done | None = None,
        *,
        grid: Grid | None = None,
        meta: ItemMeta = (),
    ) -> None:
        """Offer an embedding, the checksum of its bytes as written, its grid and its metadata,
        to be stored together in the background; returns at once.

        ``tensor``'s bytes are read later. ``done`` (if given) is called on the event loop,
        exactly once, when the store no longer reads them: the put finished, failed, or was
        dropped. An abandoned put keeps reading, and ``done`` waits for it.
        """
        ...


def _store_class() -> Any:
    try:
        module = importlib.import_module("mooncake.store")
    except (ImportError, OSError) as error:
        raise RuntimeError(
            f"--store-master needs Mooncake Store, which is not usable: {error}. Install "
            "`trio-encode[mooncake]` (and the system library libibverbs.so.1)."
        ) from error
    return module.MooncakeDistributedStore


def _warn_unkeyed(master: str) -> None:
    """Say at start what an unkeyed store exposes: nothing else would, and the forgery it
    allows is consistent, so no metric ever shows it."""
    log.warning(
        "the Mooncake Store at %s runs without a fleet secret (store_key_file): whoever reaches "
        "the master or a store client's port can put an entry with a consistent checksum that "
        "every encoder of the fleet serves as the model's embedding, undetected; and the "
        "master lists every key, and where its bytes lie, over HTTP to anyone who reaches its "
        "metrics port (mooncake_master --metrics_host, 0.0.0.0 by default). Set "
        "--store-key-file (TRIO_ENCODE_STORE_KEY_FILE) and firewall the store's ports "
        "(docs/operations.md, Security)",
        master,
    )


class MooncakeEmbeddingStore:
    """:class:`EmbeddingStore` over ``mooncake.store.MooncakeDistributedStore``.

    This encoder also lends ``segment_bytes`` of its memory to the cluster's store (Mooncake
    places objects in the segments its clients mount).
    """

    def __init__(
        self,
        *,
        master: str,
        segment_bytes: int,
        buffer_bytes: int,
        wait: float,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        observer: StoreObserver | None = None,
        secret: bytes | None = None,
    ) -> None:
        self._store_class = _store_class()  # fails now, at start-up, if Mooncake is missing
        self.master = master
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.wait = wait
        self.hostname = hostname
        self.protocol = protocol
        self.device = device
        self.observer: StoreObserver = observer or NullStoreObserver()
        self._seal = None if secret is None else _Seal(secret)
        if self._seal is None:
            _warn_unkeyed(master)
        self._client: Any | None = None
        self._warned_at = -math.inf
        self._unlogged = 0
        self._limiter = trio.CapacityLimiter(_THREADS)
        self._puts_in, self._puts_out = trio.open_memory_channel[
            tuple[str, torch.Tensor, torch.Tensor, Done | None, Grid | None, ItemMeta]
        ](_PUT_QUEUE)

    @classmethod
    def from_settings(
        cls,
        settings: EncoderSettings,
        *,
        hostname: str,
        protocol: str,
        device: str,
        observer: StoreObserver | None = None,
    ) -> MooncakeEmbeddingStore:
        if settings.store_master is None:
            raise ValueError("the store needs settings.store_master")
        return cls(
            master=settings.store_master,
            segment_bytes=settings.store_segment_bytes,
            buffer_bytes=settings.store_buffer_bytes,
            wait=settings.store_wait,
            hostname=hostname,
            protocol=protocol,
            device=device,
            observer=observer,
            secret=settings.store_secret,
        )

    def entry_name(self, key: str) -> str:
        """The name the store holds ``key``'s entry under: ``key`` itself without a fleet
        secret, else the same under the secret's own prefix (see ``_Seal``)."""
        if self._seal is None:
            return key
        return self._seal.prefix + key.removeprefix(_PREFIX)

    @property
    def connected(self) -> bool:
        return self._client is not None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while self._client is None:
                await self._connect()
                if self._client is None:
                    await trio.sleep(_RETRY_SECONDS)
            self.observer.store_connected(True)
            async for key, tensor, digest, done, grid, meta in self._puts_out:
                await self._put_now(key, tensor, digest, done, grid, meta)
        except Exception:
            # The store is an optimisation: its failure must not end the encoder it serves.
            log.exception("the store client failed; this encoder goes on without the store")
        finally:
            client, self._client = self._client, None
            self.observer.store_connected(False)
            self._drop_queued_puts()
            if client is not None:
                with trio.CancelScope(shield=True):
                    await self._close(client)

    async def _close(self, client: Any) -> None:
        """Unmount this encoder's segment so the master stops placing objects in it, once no
        call (an abandoned one included) still uses the client: holding every thread token
        proves it. Bounded: a hung master must not hold up shutdown; then the client is left
        to the process's exit. The tokens go back afterwards, so a store run again (a
        restarted encoder) has its threads."""
        holders: list[object] = []
        try:
            with trio.move_on_after(2.0):
                for _ in range(_THREADS):
                    holder = object()
                    await self._limiter.acquire_on_behalf_of(holder)
                    holders.append(holder)
                await trio.to_thread.run_sync(client.close, abandon_on_cancel=True)
        finally:
            for holder in holders:
                self._limiter.release_on_behalf_of(holder)

    def _drop_queued_puts(self) -> None:
        """Puts still queued when the store stops never run: they no longer read anything."""
        while True:
            try:
                _, _, _, done, _, _ = self._puts_out.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            self.observer.store_put("dropped")
            if done is not None:
                done()

    async def _connect(self) -> None:
        client = self._store_class()
        # setup() blocks for as long as the master is unreachable (about 90 s), and cannot be
        # interrupted: its thread is abandoned on shutdown (it touches no request's memory).
        code = await trio.to_thread.run_sync(
            client.setup,
            self.hostname,
            "P2PHANDSHAKE",
            self.segment_bytes,
            self.buffer_bytes,
            self.protocol,
            self.device,
            self.master,
            abandon_on_cancel=True,
        )
        if code == 0:
            log.info("connected to the Mooncake Store master at %s", self.master)
            self._client = client
        else:
            log.warning(
                "cannot reach the Mooncake Store master at %s (setup returned %d); requests "
                "run without the store, retrying in %.0f s",
                self.master,
                code,
                _RETRY_SECONDS,
            )

    async def get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[StoreHit | None]:
        client = self._client
        if client is None:
            self.observer.store_looked_up("unavailable", len(keys))
            return [None] * len(keys)
        targets = [
            (
                self.entry_name(key),
                tensor,
                tensor.numel() * tensor.element_size(),
                torch.empty(_DIGEST, dtype=torch.uint8),
                torch.empty(_HEADER, dtype=torch.uint8),
            )
            for key, tensor in zip(keys, into, strict=True)
        ]

        seal = self._seal

        def read() -> list[tuple[int, StoreHit | None, int]]:
            # The tensors live in ``targets``, which this function holds until it returns:
            # an abandoned read still writes only into memory it keeps alive. Each row and
            # its description are checked here, before anyone can use them.
            codes: list[int] = client.batch_get_into_multi_buffers(
                [key for key, _, _, _, _ in targets],
                [[d.data_ptr(), h.data_ptr(), row.data_ptr()] for _, row, _, d, h in targets],
                [[_DIGEST, _HEADER, nbytes] for _, _, nbytes, _, _ in targets],
            )
            checked: list[tuple[int, StoreHit | None, int]] = []
            for (key, row, nbytes, digest, header), code in zip(targets, codes, strict=True):
                hit, removed = None, 0
                if code == _DIGEST + _HEADER + nbytes:
                    checksum = tensor_checksum(row)
                    stored = bytes(digest.numpy())
                    if seal is None:
                        sealed = checksum == _stored_checksum(digest)
                    else:
                        sealed = hmac.compare_digest(seal.digest(key, row), stored)
                    if sealed:
                        hit = _described(seal, key, stored, checksum, bytes(header.numpy()))
                    if hit is None:
                        # Forced: a lease another reader holds must not keep it served.
                        removed = client.remove(key, True)
                        code = _POISONED
                checked.append((code, hit, removed))
            return checked

        checked: list[tuple[int, StoreHit | None, int]] | None = None
        with trio.move_on_after(self.wait):
            checked = await trio.to_thread.run_sync(
                read, abandon_on_cancel=True, limiter=self._limiter
            )
        if checked is None:
            self._warn("the store took over %.3f s; running the forward instead", self.wait)
            self.observer.store_looked_up("timeout", len(keys))
            return [None] * len(keys)
        found = []
        for (key, _, nbytes, _, _), (code, hit, removed) in zip(targets, checked, strict=True):
            result: LookupResult
            if hit is not None:
                result = "hit"
            elif code == _POISONED:
                result = "poisoned"
                log.warning(
                    "the store's entry %s does not match its %s: %s, encoded again "
                    "(written into through the store's memory, torn, or forged)",
                    key,
                    "checksum" if self._seal is None else "keyed digest",
                    "removed" if removed == 0 else f"not removed ({removed})",
                )
            elif code == _OBJECT_NOT_FOUND:
                result = "miss"
            else:
                result = "error"
                self._warn(
                    "store read of %s returned %d (expected %d bytes)",
                    key,
                    code,
                    _DIGEST + _HEADER + nbytes,
                )
            self.observer.store_looked_up(result, 1)
            found.append(hit)
        return found

    def _warn(self, message: str, *args: object) -> None:
        """Log a store failure, at most once per period (a dead master fails every lookup;
        the metrics count each one)."""
        now = trio.current_time()
        if now - self._warned_at < _WARN_SECONDS:
            self._unlogged += 1
            return
        if self._unlogged:
            message += f" ({self._unlogged} more store failures since the last such line)"
        log.warning(message, *args)
        self._warned_at, self._unlogged = now, 0

    def put(
        self,
        key: str,
        tensor: torch.Tensor,
        checksum: str,
        done: Done | None = None,
        *,
        grid: Grid | None = None,
        meta: ItemMeta = (),
    ) -> None:
        if self._client is not None:
            try:
                self._puts_in.send_nowait((key, tensor, _digest_bytes(checksum), done, grid, meta))
                return
            except trio.WouldBlock:
                pass
        self.observer.store_put("dropped")
        if done is not None:
            done()

    async def _put_now(
        self,
        key: str,
        tensor: torch.Tensor,
        digest: torch.Tensor,
        done: Done | None,
        grid: Grid | None = None,
        meta: ItemMeta = (),
    ) -> None:
        client = self._client
        assert client is not None
        nbytes = tensor.numel() * tensor.element_size()
        name, seal = self.entry_name(key), self._seal
        body = _body(grid, meta)
        if body is None:
            self._warn("the grid and metadata of %s are over %d bytes: not stored", name, _HEADER)
            self.observer.store_put("failed")
            if done is not None:
                done()
            return
        claim = _PutClaim(trio.lowlevel.current_trio_token(), done)

        def write() -> int | None:
            # Holds ``tensor`` until the write returns, also when abandoned; only then is
            # ``done`` called, back on the event loop, so what it gives back is not read again.
            # One object from three buffers: digest, description and row never stored apart.
            if not claim.start():
                return None  # given up on before it started: it reads nothing
            try:
                front = digest
                if seal is not None:
                    # Sealed first, then checked against the checksum the forward recorded:
                    # a row changed since (an engine write into the arena) is never sealed.
                    mac = seal.digest(name, tensor)
                    if tensor_checksum(tensor) != _stored_checksum(digest):
                        return _CHANGED
                    front = torch.frombuffer(bytearray(mac), dtype=torch.uint8)
                description = _describe(seal, name, bytes(front.numpy()), body)
                header = torch.frombuffer(bytearray(description), dtype=torch.uint8)
                codes: list[int] = client.batch_put_from_multi_buffers(
                    [name],
                    [[front.data_ptr(), header.data_ptr(), tensor.data_ptr()]],
                    [[_DIGEST, _HEADER, nbytes]],
                )
            finally:
                claim.finished()
            return codes[0]

        code: int | None = None
        with trio.move_on_after(_PUT_SECONDS):
            code = await trio.to_thread.run_sync(
                write, abandon_on_cancel=True, limiter=self._limiter
            )
        if code is None:
            claim.give_up()  # gives back at once only if the write never started
            self.observer.store_put("timeout")
        elif code == 0:
            self.observer.store_put("stored")
        elif code == _CHANGED:
            log.warning("the row of %s changed since its forward: not stored", name)
            self.observer.store_put("failed")
        else:
            self._warn("store put of %s returned %d", key, code)
            self.observer.store_put("failed")


class _PutClaim:
    """Who calls a put's ``done``: the worker thread once its write returned, or the event
    loop if the put was given up on before its thread began (waiting for a token, or started
    but not yet running). A lock decides which, so it is called exactly once and never while
    the write may still read."""

    def __init__(self, token: trio.lowlevel.TrioToken, done: Done | None) -> None:
        self._token = token
        self._done = done
        self._lock = threading.Lock()
        self._state: Literal["waiting", "writing", "given_up"] = "waiting"

    def start(self) -> bool:
        """In the thread: may the write begin? False once the loop has given up on it."""
        with self._lock:
            if self._state == "given_up":
                return False
            self._state = "writing"
            return True

    def finished(self) -> None:
        """In the thread, after the write returned: give back on the event loop."""
        if self._done is not None:
            _call_soon(self._token, self._done)

    def give_up(self) -> None:
        """On the event loop, after the bound passed: give back now unless a write began."""
        with self._lock:
            waiting = self._state == "waiting"
            self._state = "given_up" if waiting else self._state
        if waiting and self._done is not None:
            self._done()


def _call_soon(token: trio.lowlevel.TrioToken, done: Done) -> None:
    """Run ``done`` on the event loop from a worker thread (a no-op once the loop has ended:
    whatever it would give back goes with the process). An error in it is logged: raised in a
    ``run_sync_soon`` callback it would end the whole run."""

    def call() -> None:
        try:
            done()
        except Exception:
            log.exception("giving back what a store put read failed")

    with contextlib.suppress(trio.RunFinishedError):
        token.run_sync_soon(call)
