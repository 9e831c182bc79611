"""What the machine can still give without paging (no MLX here: importable below the backends):
``MemAvailable`` (``/proc/meminfo``), or a container's cgroup limit less its usage when
smaller, or psutil's figure elsewhere. ``loading.memory`` weighs models against it (and a Mac's
GPU working set); the CPU backend's tiled layers ask it before making a second copy. And the C
heap's free pages given back after a load (:func:`release_free_heap`)."""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Capacity:
    """Bytes the machine can still give, and where that figure comes from (for messages)."""

    bytes: int
    source: str


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing): parsing a large tokenizer.json leaves its transient tree freed but held, e.g. 194 MB
    of Gemma-3's 262k-token vocabulary's 290 MB (docs/performance.md). A no-op where glibc is
    absent or refuses."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _find_malloc_trim()


def available() -> Capacity | None:
    """The smallest of MemAvailable, the cgroup's room and psutil's available memory; None if
    none of them can be read."""
    found = [c for c in (_meminfo(), _cgroup(), _psutil()) if c is not None]
    return min(found, key=lambda c: c.bytes) if found else None


def _meminfo() -> Capacity | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kib = int(line.split()[1])
                    return Capacity(kib * 1024, "MemAvailable in /proc/meminfo")
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup() -> Capacity | None:
    """A container's memory limit less its usage (cgroup v2, then v1)."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None  # no limit set (v1 reports a huge number)
        return Capacity(
            max(int(limit) - usage, 0), f"the cgroup's limit less its usage ({limit_file})"
        )
    return None


def _psutil() -> Capacity | None:
    if os.path.exists("/proc/meminfo"):
        return None  # the same figure, read above
    try:
        import psutil  # optional: not a dependency
    except ImportError:
        return None
    return Capacity(int(psutil.virtual_memory().available), "psutil's available memory")
