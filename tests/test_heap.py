"""The heap tuning behind a bounded RSS: free pages inside glibc's heaps (left behind by
MB-sized blocks freed between long-lived ones) go back to the system when trimmed."""

from __future__ import annotations

import subprocess
import sys

from trio_encode.server import heap

# In a fresh process: raise glibc's dynamic mmap threshold the way a large tensor's free does,
# then fill the heap with 1 MiB blocks, each pinned by a 4 KiB neighbour (too big for the
# per-thread caches, so it comes from the heap right after it), free the big ones and report
# RSS before and after a trim.
_SCRIPT = """
import ctypes, sys
from trio_encode.server import heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
libc.free(libc.malloc(16 << 20))
big, small = [], []
for _ in range(128):
    block = libc.malloc(1 << 20)
    ctypes.memset(block, 1, 1 << 20)
    big.append(block)
    small.append(libc.malloc(4096))
for block in big:
    libc.free(block)
before = rss()
trimmed = heap.trim()
print(before, rss(), trimmed)
"""


def test_a_trim_returns_the_free_pages_between_live_blocks() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    before, after, trimmed = result.stdout.split()
    assert trimmed == "True"
    assert int(before) - int(after) > 100 << 20  # of the 128 MiB freed, nearly all returned


def test_arenas_can_be_limited() -> None:
    assert heap.limit_arenas(8)  # glibc's own default on these machines: no change in effect
