"""Linux only: run MLX's CPU matmuls on a fast BLAS instead of the reference one.

The ``mlx[cpu]`` wheel links the reference (netlib) BLAS, which is roughly 50×
slower on large matmuls. Loading a fast BLAS with RTLD_GLOBAL *before MLX is
first imported* makes MLX's BLAS symbols bind to it (Python loads extensions
with RTLD_NOW, so the binding is fixed at MLX's import). ``import mlxinfer``
does it, so the CLI and library users both get it with no extra call; an
application that imported MLX first is told so once, through ``load``'s
``log`` callback (:func:`late_warning`). On macOS MLX uses Metal and
Accelerate, and this is a no-op. docs/blas.md has the measurements.

Which library, first found wins:

1. ``MLXINFER_BLAS=/path/lib.so`` (or ``=reference`` to load none);
2. the system's OpenBLAS (Debian/Ubuntu: ``apt-get install libopenblas0-pthread``);
3. Intel MKL from the Python environment (``pip install 'mlxinfer[mkl]'``: no system
   package, but a 315 MB download), on GNU OpenMP threads.

Before a library found in 2 or 3 is loaded, ``blas_check`` makes sure (once per machine and
library, in a subprocess) that its kernels multiply right here; where they do not, it is loaded
with a safe ``OPENBLAS_CORETYPE``, or not at all. A library named by ``MLXINFER_BLAS``, or an
``OPENBLAS_CORETYPE`` already set, is the user's choice and is loaded as it is.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas*.so.0",
    "/usr/lib/libopenblas.so.0",
)
# The mkl wheel's single dynamic library, in the environment's lib/ folder.
MKL_CANDIDATES = ("libmkl_rt.so.3", "libmkl_rt.so.2")

_loaded: str | None = None  # the library loaded into this process, if any
_verdict = None  # blas_check's Verdict on the library found, when it was checked
_too_late: str | None = (
    None  # a fast BLAS there was, but MLX had been imported before it could load
)
_warned = False


def _mlx_imported() -> bool:
    return "mlx.core" in sys.modules


def find_fast_blas() -> str | None:
    """The path of the fast BLAS :func:`preload_openblas` would load, or None."""
    choice = os.environ.get("MLXINFER_BLAS", "")
    if choice == "reference":
        return None
    if choice:
        return choice
    for pattern in CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            return path
    for name in MKL_CANDIDATES:
        path = os.path.join(sys.prefix, "lib", name)
        if os.path.isfile(path):
            return path
    return None


def preload_openblas() -> str | None:
    """Load the fast BLAS (see the module doc) if MLX is not imported yet; returns its path, or None.

    ``MLXINFER_BLAS=reference`` skips it; ``MLXINFER_BLAS=/path/lib.so`` chooses the library.
    """
    global _loaded, _too_late, _verdict
    if _loaded or not sys.platform.startswith("linux"):
        return _loaded
    preloaded = [
        p
        for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
        if "openblas" in os.path.basename(p) or "libmkl_rt" in os.path.basename(p)
    ]
    if preloaded:  # loaded by the dynamic linker before anything else: MLX binds to it
        _loaded = preloaded[0]
        return _loaded
    path = find_fast_blas()
    if path is None:
        return None
    if _mlx_imported():  # too late: MLX's symbols are bound already
        _too_late = path
        return None
    if "libmkl_rt" in os.path.basename(path):
        # MKL's default threading needs Intel's OpenMP runtime; GNU's comes with gcc. Set before
        # the check, so that its probe loads MKL as this process will.
        os.environ.setdefault("MKL_THREADING_LAYER", "GNU")
    if _checked():
        from . import blas_check

        _verdict = blas_check.decide(path)
        if not _verdict.load:
            return None
        if _verdict.core is not None:  # read by OpenBLAS when it is loaded, just below
            os.environ["OPENBLAS_CORETYPE"] = _verdict.core
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    _loaded = path
    return path


def _checked() -> bool:
    """Whether the library found is checked before it is loaded: not when the user chose the
    library (``MLXINFER_BLAS``) or OpenBLAS's kernels (``OPENBLAS_CORETYPE``, even empty)."""
    return not os.environ.get("MLXINFER_BLAS") and "OPENBLAS_CORETYPE" not in os.environ


def late_warning() -> str | None:
    """Once per process: the message saying MLX runs on the reference BLAS because it was
    imported before mlxinfer, with the fix; None if that is not the case."""
    global _warned
    if _loaded or _warned or not sys.platform.startswith("linux") or not _mlx_imported():
        return None
    if _verdict is not None and not _verdict.load:  # left out on purpose (blas_in_use says why)
        return None
    path = _too_late or find_fast_blas()
    if path is None:
        return None
    _warned = True
    return (
        f"MLX was imported before mlxinfer, so its CPU matmuls run on the reference BLAS (prefill ~5x "
        f"slower) although {path} is installed: import mlxinfer before mlx, or start Python with "
        f"LD_PRELOAD={path}"
    )


def preloaded_blas() -> str | None:
    """The path of the BLAS library :func:`preload_openblas` loaded, or None.

    A child process (``mlxinfer bench --compare``) gets it as ``LD_PRELOAD``
    so that it runs on the same BLAS.
    """
    return _loaded


def blas_in_use() -> str:
    """A one-line description of the BLAS MLX's CPU matmuls run on, with its kernels and what
    the check before loading it found."""
    if sys.platform == "darwin":
        return "Metal (GPU) / Accelerate (CPU)"
    if _loaded:
        name = "MKL" if "libmkl_rt" in _loaded else "OpenBLAS"
        core = _corename(_loaded)
        kernels = f", {core} kernels" if core else ""
        if _verdict is not None:
            found = _verdict.note
        elif os.environ.get("MLXINFER_BLAS"):
            found = "named by MLXINFER_BLAS, not checked"
        elif "OPENBLAS_CORETYPE" in os.environ:
            found = f"OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']!r} as set, not checked"
        else:
            found = "in LD_PRELOAD, not checked"
        return f"{name} ({_loaded}){kernels}; {found}"
    if _verdict is not None and not _verdict.load:
        return f"reference BLAS (slow): not loading {find_fast_blas()}, {_verdict.note}"
    return "reference BLAS (slow; install libopenblas0-pthread)"


def _corename(path: str) -> str | None:
    """The kernels a loaded OpenBLAS chose (``openblas_get_corename``), or None."""
    try:
        lib = ctypes.CDLL(path)  # already loaded: the same handle, no second load
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return lib.openblas_get_corename().decode()
    except (OSError, AttributeError):
        return None
