"""Keeping the server's resident memory near what it actually holds (glibc's malloc).

Left alone, a busy server's RSS climbs far above its live data and stays there. Measured with
``trio-encode soak`` (TP=4, 200 distinct images, 256 MiB cache): every byte correct and nothing
left live, yet RSS went from 0.9 GiB after warm-up to 1.6 GiB after 2,000 requests. The bytes
are MB-sized tensors (pixels, activations, embeddings) that glibc serves from its heaps:

- each worker thread that allocates gets an arena of its own (up to 8 per core), and a tensor
  allocated in one thread (the forward pass) and freed in another (the event loop, when a cache
  entry is evicted or a scope drops its embedding) goes back to the allocating thread's arena;
- after the first large ``free``, glibc raises its mmap threshold to that size (up to 32 MiB),
  so later MB-sized tensors come from the heaps instead of ``mmap``; long-lived cache entries
  pin the heaps' pages between short-lived activations, and a heap only shrinks from its top.

So the server caps the arenas (few threads allocate at once anyway) and asks glibc now and then
to return the free pages inside its heaps (``malloc_trim``, which since glibc 2.8 releases
every whole free page, not only the top). The forward pass keeps reusing heap memory at full
speed; what lies free between two trims is bounded by one interval's churn. Elsewhere than
glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache

import trio

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt parameter numbers, from glibc's malloc.h


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None  # not glibc: nothing to tune
    return libc


def limit_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas (call before threads start). False where it cannot."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, arenas))


def trim() -> bool:
    """Return every whole free page of the heaps to the system; True if any was."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


async def trim_every(seconds: float) -> None:
    """Trim the heaps every ``seconds``, in a worker thread (a trim walks every arena)."""
    if _libc() is None:
        log.info("not glibc: the heap is not trimmed")
        return
    while True:
        await trio.sleep(seconds)
        await trio.to_thread.run_sync(trim)
