"""The check that the fast BLAS multiplies right on this machine, run once before it is loaded
(mlxinfer/platform/blas_check.py, blas_probe.py; docs/blas.md).

The probe's judgement is tested on a stand-in ``cblas_sgemm`` whose products are right, or one
entry off; the choice of kernels on probe results given to it; the load itself, in a fresh
process, on the installed OpenBLAS (skipped where there is none)."""

import ctypes
import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from mlxinfer.platform import blas_check, blas_probe
from mlxinfer.platform.blas import find_fast_blas

LIBRARY = find_fast_blas() if sys.platform.startswith("linux") else None


def dynamic_x86_openblas() -> bool:
    """An x86 OpenBLAS built with DYNAMIC_ARCH (Debian's): one that honours OPENBLAS_CORETYPE."""
    if LIBRARY is None or "openblas" not in os.path.basename(LIBRARY):
        return False
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        lib = ctypes.CDLL(LIBRARY)
        lib.openblas_get_config.restype = ctypes.c_char_p
        return b"DYNAMIC_ARCH" in lib.openblas_get_config()
    except (OSError, AttributeError):
        return False


needs_openblas = pytest.mark.skipif(
    not dynamic_x86_openblas(),
    reason="no x86 OpenBLAS with DYNAMIC_ARCH installed (apt-get install libopenblas0-pthread)",
)


class StandIn:
    """A ``cblas_sgemm`` computed in float64 and rounded once (within the bound by far), with
    entry (0, 0) of every product ``off`` away."""

    def __init__(self, off: float) -> None:
        self.off = off

    def cblas_sgemm(self, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        t = blas_probe.TRANS
        a = np.ctypeslib.as_array(a, ((k, m) if ta == t else (m, k))).astype(np.float64)
        b = np.ctypeslib.as_array(b, ((n, k) if tb == t else (k, n))).astype(np.float64)
        out = np.ctypeslib.as_array(c, (m, n))
        product = (a.T if ta == t else a) @ (b.T if tb == t else b)
        out[:] = alpha.value * product + beta.value * out
        out[0, 0] += self.off


def test_the_probe_passes_right_products_and_fails_one_entry_off():
    """The bound is float32's for a K-term dot product, (K + 2) u (|A| |B| + |beta C|): a product
    rounded once is within u of that sum, 1 / (K + 2) of the bound, 1/26 for the smallest K (24);
    one entry 1e-3 off is far outside it."""
    right = blas_probe.worst(StandIn(0.0))
    assert right["ratio"] <= 1 / 26
    wrong = blas_probe.worst(StandIn(1e-3))
    assert wrong["ratio"] > 1 and wrong["error"] == pytest.approx(1e-3, rel=1e-2)
    assert blas_probe.worst(StandIn(float("nan")))["ratio"] == float("inf")


def results(by_core):
    """A stand-in for :func:`blas_check.probe`: the result for each core type (None: the
    library's own choice), recording the calls."""
    calls = []

    def probe(path, core):
        calls.append(core)
        return by_core[core]

    return probe, calls


PASS = {"ok": True, "ratio": 0.13, "shape": "32x24 by 24x64", "error": 2.6e-6}
FAIL = {"ok": False, "ratio": 40.0, "shape": "17x255 by 255x127", "error": 3e-4}


def test_kernels_that_fail_are_replaced_by_the_first_safe_core_that_passes(monkeypatch):
    probe, calls = results(
        {
            None: {**FAIL, "core": "Cooperlake"},
            "Haswell": {**FAIL, "core": "Haswell"},
            "Nehalem": {**PASS, "core": "Nehalem"},
        }
    )
    monkeypatch.setattr(blas_check, "probe", probe)
    verdict = blas_check.judge("/lib/libopenblas.so.0")
    assert (verdict.load, verdict.core) == (True, "Nehalem") and calls == [
        None,
        *blas_check.SAFE_CORES,
    ]
    assert "Cooperlake kernels failed the check (worst 17x255 by 255x127" in verdict.note
    # None passes: no fast BLAS. A library that is not OpenBLAS has no core types to try.
    probe, calls = results({None: {**FAIL, "core": "Cooperlake"}, "Haswell": FAIL, "Nehalem": FAIL})
    monkeypatch.setattr(blas_check, "probe", probe)
    assert blas_check.judge("/lib/libopenblas.so.0").load is False
    probe, calls = results({None: {**FAIL, "core": None}})
    monkeypatch.setattr(blas_check, "probe", probe)
    assert blas_check.judge("/lib/libmkl_rt.so.3").load is False and calls == [None]


def test_the_verdict_is_cached_per_machine_and_library_and_the_check_not_rerun(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    library = tmp_path / "libopenblas.so.0"
    library.write_bytes(b"x")
    probe, calls = results({None: {**PASS, "core": "SkylakeX"}})
    monkeypatch.setattr(blas_check, "probe", probe)
    first = blas_check.decide(str(library))
    assert (first.load, first.core) == (True, None) and calls == [None]
    assert blas_check.decide(str(library)) == first and calls == [None]  # read, not run again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blas-check.json", library.name]
    entry = json.loads((tmp_path / "blas-check.json").read_text())[
        blas_check.cache_key(str(library))
    ]
    assert entry == {"load": True, "core": None, "note": first.note}
    library.write_bytes(b"xy")  # another library file (a new package): checked again
    blas_check.decide(str(library))
    assert calls == [None, None]


def test_a_check_that_cannot_finish_loads_the_library_as_before_and_caches_nothing(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(blas_check, "TIMEOUT_S", 0.001)
    verdict = blas_check.decide(sys.executable)  # any file: the probe is cut off first
    assert (verdict.load, verdict.core) == (True, None)
    assert verdict.note == "not checked: the check did not finish in 0.001 s"
    assert not (tmp_path / "blas-check.json").exists()


def fresh_import(code: str, tmp_path, **env) -> list[str]:
    """Run ``code`` in a fresh interpreter with the test's cache in ``tmp_path``, no BLAS
    chosen by the environment except by ``env``; its output lines."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", "MLXINFER_BLAS", "OPENBLAS_CORETYPE")
    }
    run = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, "MLXINFER_CACHE": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


SIMULATED = """
import os
os.environ["MLXINFER_BLAS"] = "reference"  # imported without loading a BLAS, to stand the probe in
from mlxinfer.platform import blas, blas_check
del os.environ["MLXINFER_BLAS"]
def probe(path, core):  # the library's own kernels fail, Haswell's pass
    if core is None:
        return {"ok": False, "core": "SkylakeX", "ratio": 40.0, "shape": "17x255 by 255x127",
                "error": 3e-4}
    return {"ok": core == "Haswell", "core": core, "ratio": 0.1, "shape": "1x256 by 256x1024",
            "error": 1e-6}
blas_check.probe = probe
blas.preload_openblas()
print(os.environ.get("OPENBLAS_CORETYPE"))
print(blas.blas_in_use())
"""

REPORT = """
import os, mlxinfer
from mlxinfer.platform import blas
print(os.environ.get("OPENBLAS_CORETYPE"))
print(blas.blas_in_use())
"""


@needs_openblas
def test_failing_kernels_load_openblas_with_a_safe_core_type(tmp_path):
    """OpenBLAS reads OPENBLAS_CORETYPE at load: the library then reports Haswell kernels, so
    the core type was set before it loaded. A later import reads the cached verdict."""
    coretype, in_use = fresh_import(SIMULATED, tmp_path)
    assert coretype == "Haswell"
    assert in_use.startswith(f"OpenBLAS ({LIBRARY}), Haswell kernels; SkylakeX kernels failed")
    coretype, in_use = fresh_import(REPORT, tmp_path)  # the real probe would pass: not run
    assert coretype == "Haswell" and "Haswell kernels; SkylakeX kernels failed" in in_use


@needs_openblas
def test_an_explicit_coretype_or_library_is_loaded_as_set_and_not_checked(tmp_path):
    (tmp_path / "blas-check.json").write_text(
        json.dumps({blas_check.cache_key(LIBRARY): {"load": False, "core": None, "note": "x"}})
    )  # a verdict against the library: not read
    coretype, in_use = fresh_import(REPORT, tmp_path, OPENBLAS_CORETYPE="Zen")
    assert coretype == "Zen"
    assert (
        in_use == f"OpenBLAS ({LIBRARY}), Zen kernels; OPENBLAS_CORETYPE='Zen' as set, not checked"
    )
    _, in_use = fresh_import(REPORT, tmp_path, MLXINFER_BLAS=LIBRARY)
    assert in_use.startswith(f"OpenBLAS ({LIBRARY}), ") and in_use.endswith(
        "; named by MLXINFER_BLAS, not checked"
    )


@needs_openblas
def test_the_real_check_here_caches_a_verdict_and_the_load_follows_it(tmp_path):
    """The installed OpenBLAS, probed for real in a fresh process: the verdict is cached and the
    library loaded as it says (every core type measured so far passes: docs/blas.md)."""
    coretype, in_use = fresh_import(REPORT, tmp_path)
    (entry,) = json.loads((tmp_path / "blas-check.json").read_text()).values()
    assert entry["load"] and in_use.startswith(f"OpenBLAS ({LIBRARY}), ")
    assert in_use.endswith(f" kernels; {entry['note']}") and coretype == str(entry["core"])
    if entry["core"] is None:
        assert entry["note"].startswith("checked on this machine (worst ")
