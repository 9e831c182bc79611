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
    global _loaded, _too_late
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
        # MKL's default threading needs Intel's OpenMP runtime; GNU's comes with gcc.
        os.environ.setdefault("MKL_THREADING_LAYER", "GNU")
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    _loaded = path
    return path


def late_warning() -> str | None:
    """Once per process: the message saying MLX runs on the reference BLAS because it was
    imported before mlxinfer, with the fix; None if that is not the case."""
    global _warned
    if _loaded or _warned or not sys.platform.startswith("linux") or not _mlx_imported():
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
    """A one-line description of the BLAS MLX's CPU matmuls run on."""
    if sys.platform == "darwin":
        return "Metal (GPU) / Accelerate (CPU)"
    if _loaded:
        return f"{'MKL' if 'libmkl_rt' in _loaded else 'OpenBLAS'} ({_loaded})"
    return "reference BLAS (slow; install libopenblas0-pthread)"
