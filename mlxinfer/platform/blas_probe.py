"""Run by ``blas_check`` as a script in a fresh process: load one CBLAS library, multiply at the
shapes MLX's CPU backend multiplies at, and print one JSON line saying how far each product is
from float64.

``python blas_probe.py LIBRARY``. The library is loaded here under whatever ``OPENBLAS_CORETYPE``
this process was given (OpenBLAS reads it when it is loaded, so each core type tried needs a
process of its own). Nothing here imports mlxinfer or MLX: the probe sees the library alone.

MLX calls one BLAS routine on the CPU, ``cblas_sgemm`` (``nm -D libmlx.so``: its other BLAS
and LAPACK symbols serve ``mx.linalg``), row-major, with either operand transposed, and
``beta`` 1 for ``addmm``. A product is right when every entry is within float32's error bound
for a K-term dot product, ``(K + 2) u (|A| |B| + |beta C|)`` with ``u = 2^-24``; a correct
kernel in any order of summation is within it, and every OpenBLAS core type measured stays
below a third of it (docs/blas.md). A broken kernel is off by far more.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
U = 2.0**-24  # float32's unit roundoff

# (M, K, N, A transposed, B transposed, beta): C (M, N) = op(A) (M, K) @ op(B) (K, N) + beta C.
SHAPES = (
    (1, 256, 1024, False, True, 0.0),  # decode: one row by a weight held (out, in), x @ W.T
    (1, 1024, 256, False, True, 1.0),  # the same with a bias (addmm)
    (3, 256, 512, False, True, 0.0),  # a few rows: batched decode, speculative verification
    (16, 256, 512, False, True, 1.0),  # decode rows padded to 16 (ops.padded_product)
    (17, 255, 127, False, False, 0.0),  # sizes that are no multiple of any kernel's block
    (32, 64, 24, False, True, 0.0),  # attention scores: grouped queries by 24 cached keys
    (32, 24, 64, False, False, 0.0),  # probabilities by values
    (24, 64, 8, False, True, 0.0),  # the long-context form: cached keys by the queries
    (64, 48, 40, True, True, 1.0),  # both operands transposed
    (64, 256, 1024, False, True, 0.0),  # a prefill block, large enough to be threaded
)


def worst(lib: ctypes.CDLL) -> dict:
    """The product furthest from float64, as a fraction of its error bound (over 1: wrong)."""
    import numpy as np

    floats = ctypes.POINTER(ctypes.c_float)
    rng = np.random.default_rng(0)
    found = {"ratio": 0.0}
    for m, k, n, ta, tb, beta in SHAPES:
        a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
        c = rng.standard_normal((m, n), dtype=np.float32)
        a64, b64 = (a.T if ta else a).astype(np.float64), (b.T if tb else b).astype(np.float64)
        expected = a64 @ b64 + beta * c
        bound = (k + 2) * U * (np.abs(a64) @ np.abs(b64) + abs(beta) * np.abs(c))
        got = c.copy()
        lib.cblas_sgemm(
            ROW_MAJOR,
            TRANS if ta else NO_TRANS,
            TRANS if tb else NO_TRANS,
            m,
            n,
            k,
            ctypes.c_float(1.0),
            a.ctypes.data_as(floats),
            a.shape[1],
            b.ctypes.data_as(floats),
            b.shape[1],
            ctypes.c_float(beta),
            got.ctypes.data_as(floats),
            n,
        )
        ratio = float(np.max(np.abs(got - expected) / bound))
        if not np.isfinite(ratio):
            ratio = float("inf")
        if ratio >= found["ratio"]:
            error = float(np.max(np.abs(got - expected))) if np.isfinite(got).all() else None
            shape = f"{m}x{k} by {k}x{n}{' (A^T)' if ta else ''}{' (B^T)' if tb else ''}"
            found = {
                "ratio": ratio,
                "shape": shape + (f", beta {beta:g}" if beta else ""),
                "error": error,
            }
    return found


def main(path: str) -> dict:
    try:
        import numpy  # noqa: F401  (the float64 reference)
    except ImportError as e:
        return {"unchecked": f"numpy: {e}"}
    start = time.monotonic()
    try:
        lib = ctypes.CDLL(path)
        lib.cblas_sgemm.restype = None
    except (OSError, AttributeError) as e:
        return {"ok": False, "error": f"cannot load: {e}"}
    core = config = None
    if hasattr(lib, "openblas_get_corename"):
        lib.openblas_get_corename.restype = lib.openblas_get_config.restype = ctypes.c_char_p
        core = lib.openblas_get_corename().decode()
        config = lib.openblas_get_config().decode()
    found = worst(lib)
    return {
        "ok": found["ratio"] <= 1.0,
        "core": core,
        "config": config,
        **found,
        "seconds": round(time.monotonic() - start, 3),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
