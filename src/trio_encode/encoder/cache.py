"""Embeddings of items already seen, keyed by content, bounded in bytes, evicted LRU.

An item's key (:func:`content_key`) names everything its rows depend on besides the model's
fingerprint: its bytes, its modality (the same bytes as an image and as a video are different
rows) and its recipe (how its bytes became the model's input: a video's frame sampling).

A hit returns the very tensor that was stored, not a copy: two requests for one image then
share memory, which the request lifecycle must handle (register once per address range).
Each entry keeps the checksum of its bytes as they were written: a row is registered with the
transfer engine while a request sends it, and anyone who reaches the engine's port can write it
then, so the encoder compares a hit with it before serving it (:meth:`EmbeddingCache.discard`
drops one that no longer matches).
Stored tensors may be views into one batched output; the cache counts the memory it actually
keeps alive (each underlying storage once), so its bound is honest.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from trio_encode.encoder.backend import ItemMeta
from trio_encode.request_types import Grid


@dataclass(frozen=True)
class CacheKey:
    """What one item's kept row is found by: locally, in flight, and in the store."""

    model_id: str
    sha256: str
    """Of the item's encoded bytes."""
    modality: str = "IMAGE"
    """SGLang's modality the item was sent as (``IMAGE``, ``VIDEO``, ...)."""
    recipe: str = ""
    """A digest of the settings that turn the item's bytes into the model's input beyond the
    model itself (a video's frame sampling and resize bounds); empty where there are none."""


def content_key(model_id: str, data: bytes, modality: str = "IMAGE", recipe: str = "") -> CacheKey:
    """The key of an item: its model, the sha256 of its encoded bytes, its modality and its
    modality's recipe (the one place a key is made)."""
    return CacheKey(model_id, hashlib.sha256(data).hexdigest(), modality, recipe)


class EmbeddingCache:
    """LRU map from :class:`CacheKey` to a per-image ``(tokens, hidden)`` tensor.

    Not thread-safe: use it from the event loop only.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[CacheKey, torch.Tensor] = OrderedDict()
        self._grids: dict[CacheKey, Grid] = {}  # for the entries whose image has a grid
        self._meta: dict[CacheKey, ItemMeta] = {}  # for the entries whose item has metadata
        self._digests: dict[CacheKey, str] = {}  # each entry's checksum when it was written
        # storage address -> [bytes of the storage, entries that keep it alive]
        self._storages: dict[int, list[int]] = {}
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of memory the cache keeps alive."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def get(self, key: CacheKey) -> torch.Tensor | None:
        tensor = self._entries.get(key)
        if tensor is not None:
            self._entries.move_to_end(key)
        return tensor

    def grid(self, key: CacheKey) -> Grid | None:
        """The grid kept with ``key``'s entry (None: none, or no entry)."""
        return self._grids.get(key)

    def meta(self, key: CacheKey) -> ItemMeta:
        """The metadata kept with ``key``'s entry (empty: none, or no entry)."""
        return self._meta.get(key, ())

    def digest(self, key: CacheKey) -> str | None:
        """The checksum of ``key``'s entry when it was written (None: no entry)."""
        return self._digests.get(key)

    def put(
        self,
        key: CacheKey,
        tensor: torch.Tensor,
        digest: str,
        grid: Grid | None = None,
        meta: ItemMeta = (),
    ) -> None:
        """Keep ``tensor``, the checksum of its bytes as written (``digest``), its item's
        ``grid`` and ``meta`` (an existing entry for ``key`` wins), then evict least recently
        used entries until the bound holds. A tensor bigger than the bound is not kept."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() > self.max_bytes:
            return
        self._entries[key] = tensor
        self._digests[key] = digest
        if grid is not None:
            self._grids[key] = grid
        if meta:
            self._meta[key] = meta
        self._retain(storage.data_ptr(), storage.nbytes())
        while self._bytes > self.max_bytes:
            self._evict_oldest()

    def discard(self, key: CacheKey, tensor: torch.Tensor) -> bool:
        """Drop ``key``'s entry if it is still ``tensor`` (not one kept since); whether it was.
        Requests that hold the tensor keep it; the cache no longer serves it."""
        if self._entries.get(key) is not tensor:
            return False
        del self._entries[key]
        self._forget(key, tensor)
        return True

    def clear(self) -> None:
        self._entries.clear()
        self._grids.clear()
        self._meta.clear()
        self._digests.clear()
        self._storages.clear()
        self._bytes = 0

    def _retain(self, address: int, nbytes: int) -> None:
        held = self._storages.get(address)
        if held is None:
            self._storages[address] = [nbytes, 1]
            self._bytes += nbytes
        else:
            held[1] += 1

    def _evict_oldest(self) -> None:
        key, tensor = self._entries.popitem(last=False)
        self._forget(key, tensor)

    def _forget(self, key: CacheKey, tensor: torch.Tensor) -> None:
        self._grids.pop(key, None)
        self._meta.pop(key, None)
        self._digests.pop(key, None)
        address = tensor.untyped_storage().data_ptr()
        held = self._storages[address]
        held[1] -= 1
        if held[1] == 0:
            del self._storages[address]
            self._bytes -= held[0]
