"""Whether the fast BLAS multiplies right on this machine: checked once per machine and library,
in a fresh process, before ``blas`` loads it into this one.

OpenBLAS picks its kernels for the CPU when it is loaded (``DYNAMIC_ARCH``) and reads
``OPENBLAS_CORETYPE`` only then, so a verdict must come before the load. :func:`decide` runs
``blas_probe.py`` in a subprocess: it loads the library as this process would, multiplies at
the shapes MLX's CPU backend uses and compares with float64. If the products are off, it tries
a safe core type in another subprocess (:data:`SAFE_CORES`) and, if one passes, ``blas`` loads
the library with it; if none does, ``blas`` loads no fast BLAS at all. ``mlxinfer generate
--verbose`` says which (``blas.blas_in_use``).

The verdict is cached in the user cache (``blas-check.json``), keyed by the CPU's model name
and flags, the number of CPUs, and the library's real path, size and modification time (so a
new OpenBLAS package is checked again), so later imports read one small file. A probe that
cannot finish (:data:`TIMEOUT_S`) or cannot run gives no verdict and nothing is cached: the
library is loaded as before. An explicit ``OPENBLAS_CORETYPE`` or ``MLXINFER_BLAS`` is the
user's choice and is never checked (``blas`` does not call this then).
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path

from ..files import entries
from .machine import user_cache_dir

VERSION = 1  # of the probe and the cached entries: bump when either changes
# Tried in turn when the library's own choice of kernels fails: OpenBLAS's AVX2 kernels, then its
# SSE ones. A core the CPU cannot run fails its probe (the subprocess dies), never this process.
SAFE_CORES = ("Haswell", "Nehalem")
TIMEOUT_S = 30.0  # per probe; about 1 s on a loaded 2-core VM
PROBE = Path(__file__).with_name("blas_probe.py")


class Verdict:
    """What ``blas`` does with a library: load it (with ``core`` as ``OPENBLAS_CORETYPE``,
    or its own choice when None) or not; ``note`` says why, in a few words. (A plain class:
    ``dataclasses`` would add 15 ms to every ``import mlxinfer``.)"""

    __slots__ = ("load", "core", "note")

    def __init__(self, load: bool, core: str | None, note: str) -> None:
        self.load, self.core, self.note = load, core, note

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Verdict) and (self.load, self.core, self.note) == (
            other.load,
            other.core,
            other.note,
        )

    def __repr__(self) -> str:
        return f"Verdict(load={self.load}, core={self.core!r}, note={self.note!r})"


class Unchecked(Exception):
    """The probe could not run or finish (no verdict either way)."""


def cpu_identity() -> tuple[str, str]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ('', '') where there is none."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        pass
    return fields.get("model name", ""), fields.get("flags", fields.get("Features", ""))


def cache_key(path: str) -> str:
    """The CPU, and the library file by its real path, size and modification time."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
        stamp = [st.st_size, st.st_mtime_ns]
    except OSError:
        stamp = None
    data = json.dumps([VERSION, *cpu_identity(), os.cpu_count(), real, stamp]).encode()
    return f"{zlib.crc32(data):08x}-{zlib.adler32(data):08x}"  # no hashlib: 8 ms to import


def cache_path() -> Path:
    return user_cache_dir() / "blas-check.json"


def read_entries() -> dict:
    return entries.read_entries(cache_path())


def store_entry(key: str, entry: dict) -> None:
    """Add one verdict to the cache file (``files/entries.py``: atomic; skipped if it cannot be
    written, and the check then runs again next time)."""
    entries.store_entry(cache_path(), key, entry)


def probe(path: str, core: str | None) -> dict:
    """Run ``blas_probe.py`` on ``path`` in a fresh process, with ``core`` as
    ``OPENBLAS_CORETYPE`` (None: unset); its JSON result.

    Raises:
      Unchecked: no interpreter to run it with, no numpy, a timeout, or output that is not
        the probe's.
    """
    import subprocess

    if not sys.executable or getattr(sys, "frozen", False):
        raise Unchecked("no Python interpreter to run the check with")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    if core is not None:
        env["OPENBLAS_CORETYPE"] = core
    try:
        run = subprocess.run(
            [sys.executable, str(PROBE), path],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise Unchecked(f"the check did not finish in {TIMEOUT_S:g} s") from None
    except OSError as e:
        raise Unchecked(f"the check could not start: {e}") from None
    if run.returncode < 0:  # killed by a signal: an instruction the CPU lacks, a crash
        return {"ok": False, "error": f"the probe died (signal {-run.returncode})"}
    try:
        result = json.loads(run.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise Unchecked(f"the check failed: {tail}") from None
    if "unchecked" in result:
        raise Unchecked(result["unchecked"])
    return result


def _described(result: dict) -> str:
    """One probe's result in a few words."""
    if "ratio" not in result:
        return result.get("error", "failed")
    return f"worst {result['shape']}, off by {result['error']:.2g}, {result['ratio']:.2f}x float32's bound"


def judge(path: str) -> Verdict:
    """Probe ``path`` with its own kernels, then with each of :data:`SAFE_CORES` while it fails."""
    first = probe(path, None)
    own = first.get("core")
    if first.get("ok"):
        return Verdict(True, None, f"checked on this machine ({_described(first)})")
    failed = f"{own or 'its own'} kernels failed the check ({_described(first)})"
    if own is None:  # not OpenBLAS, or not loadable: no core type to choose
        return Verdict(False, None, failed)
    for core in SAFE_CORES:
        if core == own:
            continue
        try:
            result = probe(path, core)
        except Unchecked:
            continue
        if result.get("ok") and result.get("core") == core:
            return Verdict(True, core, f"{failed}; {core} kernels passed")
    return Verdict(False, None, f"{failed}, and so did {', '.join(SAFE_CORES)}")


def decide(path: str) -> Verdict:
    """The cached verdict for ``path`` on this machine, else :func:`judge`'s (then cached)."""
    key = cache_key(path)
    entry = read_entries().get(key)
    if (
        isinstance(entry, dict)
        and isinstance(entry.get("load"), bool)
        and isinstance(entry.get("core"), (str, type(None)))
    ):
        return Verdict(entry["load"], entry["core"], str(entry.get("note", "")))
    try:
        verdict = judge(path)
    except Unchecked as e:
        return Verdict(True, None, f"not checked: {e}")
    store_entry(key, {"load": verdict.load, "core": verdict.core, "note": verdict.note})
    return verdict
