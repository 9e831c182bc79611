"""Linux only: run MLX's CPU matmuls on OpenBLAS instead of the reference BLAS.

The ``mlx[cpu]`` wheel links the reference (netlib) BLAS, which is roughly 50×
slower on large matmuls. Loading OpenBLAS with RTLD_GLOBAL *before the first
``import mlx``* makes MLX's BLAS symbols resolve to it. The CLI calls
:func:`preload_openblas` first thing; library users may call it themselves
(importing mlxinfer alone does nothing). On macOS MLX uses Metal and
Accelerate, and this is a no-op.
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

_loaded: str | None = None  # the library loaded into this process, if any


def preload_openblas() -> str | None:
    """Load the system OpenBLAS if there is one; returns its path, or None.

    Set ``MLXINFER_BLAS=reference`` to skip it; ``MLXINFER_BLAS=/path/lib.so``
    to choose the library.
    """
    global _loaded
    if _loaded or not sys.platform.startswith("linux"):
        return _loaded
    choice = os.environ.get("MLXINFER_BLAS", "")
    if choice == "reference":
        return None
    paths = [choice] if choice else [p for pattern in CANDIDATES for p in sorted(glob.glob(pattern))]
    for path in paths:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _loaded = path
        return path
    return None


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
    return f"OpenBLAS ({_loaded})" if _loaded else "reference BLAS (slow; install libopenblas0-pthread)"
