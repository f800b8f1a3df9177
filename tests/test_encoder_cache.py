"""The embedding cache: content keys, LRU by bytes, hits return the stored memory itself."""

from __future__ import annotations

import torch

from trio_encode.embedding import tensor_checksum
from trio_encode.encoder.cache import CacheKey, EmbeddingCache, content_key

ROW = 4 * 16 * 4  # bytes of one (4, 16) float32 entry


def entry(value: float) -> torch.Tensor:
    return torch.full((4, 16), float(value), dtype=torch.float32)


def keep(cache: EmbeddingCache, key: CacheKey, tensor: torch.Tensor) -> None:
    cache.put(key, tensor, tensor_checksum(tensor))


def test_keys_depend_on_content_and_model() -> None:
    assert content_key("m", b"abc") == content_key("m", b"abc")
    assert content_key("m", b"abc") != content_key("m", b"abd")
    assert content_key("m", b"abc") != content_key("other", b"abc")


def test_hit_returns_the_same_memory() -> None:
    cache = EmbeddingCache(10 * ROW)
    tensor = entry(1.0)
    keep(cache, content_key("m", b"a"), tensor)
    hit = cache.get(content_key("m", b"a"))
    assert hit is tensor
    assert cache.get(content_key("m", b"b")) is None


def test_lru_eviction_by_bytes() -> None:
    cache = EmbeddingCache(3 * ROW)
    keys = [content_key("m", bytes([i])) for i in range(4)]
    for i in range(3):
        keep(cache, keys[i], entry(i))
    assert cache.nbytes == 3 * ROW
    assert cache.get(keys[0]) is not None  # 0 is now the most recently used
    keep(cache, keys[3], entry(3))
    assert keys[1] not in cache
    assert all(key in cache for key in (keys[0], keys[2], keys[3]))
    assert cache.nbytes == 3 * ROW
    assert len(cache) == 3


def test_an_existing_entry_wins_and_oversized_entries_are_not_kept() -> None:
    cache = EmbeddingCache(2 * ROW)
    key = content_key("m", b"a")
    first = entry(1.0)
    keep(cache, key, first)
    keep(cache, key, entry(2.0))
    assert cache.get(key) is first
    keep(cache, content_key("m", b"big"), torch.zeros(3 * ROW // 4))
    assert len(cache) == 1
    assert cache.nbytes == ROW


def test_views_into_one_storage_are_counted_once() -> None:
    batch = torch.zeros(3, 4, 16)
    cache = EmbeddingCache(3 * ROW)
    for i in range(3):
        keep(cache, content_key("m", bytes([i])), batch[i])
    assert cache.nbytes == 3 * ROW
    # The batch's memory stays alive until its last view leaves the cache.
    keep(cache, content_key("m", b"x"), entry(9.0))
    keep(cache, content_key("m", b"y"), entry(9.0))
    assert len(cache) == 2
    assert cache.nbytes == 2 * ROW
    cache.clear()
    assert cache.nbytes == 0


def test_a_discarded_entry_is_gone_unless_it_was_replaced_meanwhile() -> None:
    cache = EmbeddingCache(3 * ROW)
    key = content_key("m", b"a")
    first = entry(1.0)
    keep(cache, key, first)
    assert cache.digest(key) == tensor_checksum(first)
    assert cache.discard(key, first)
    assert (key in cache, cache.digest(key), cache.nbytes) == (False, None, 0)
    second = entry(2.0)
    keep(cache, key, second)
    assert not cache.discard(key, first), "a later entry is not dropped for an earlier one"
    assert cache.get(key) is second
