"""The C heap's free pages given back after load (``platform.memory.release_free_heap``): a
large tokenizer.json's parse leaves its transient tree freed but held by glibc's heap."""

import ctypes
import platform

import pytest

from mlxinfer.platform import memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's: elsewhere the call does nothing")
def test_freed_small_allocations_go_back_to_the_system():
    """200 MB in 1 KiB chunks (below glibc's mmap threshold: they come from the heap), the last
    one kept so the heap's top cannot shrink by itself, then freed: held until the release gives
    most of it back."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(1024) for _ in range(200_000)]
    for p in chunks:
        ctypes.memset(p, 1, 1024)  # touched: resident
    keep = libc.malloc(1024)
    for p in chunks:
        libc.free(p)
    held = _rss_bytes()
    memory.release_free_heap()
    assert held - _rss_bytes() > 100e6
    libc.free(keep)


def test_the_release_is_safe_anywhere():
    """Twice in a row, on any system: nothing to give back is not an error."""
    memory.release_free_heap()
    memory.release_free_heap()
