"""Per-run device settings.

On a Mac, Metal may page a large model's buffers out of GPU-visible memory
between steps; wiring them (``mx.set_wired_limit``) keeps them resident for the
run. It needs macOS 15 and Metal; elsewhere (MLX's CPU or CUDA backends) the
context manager does nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx


@contextmanager
def wired_limit(model_bytes: int = 0) -> Iterator[None]:
    """Raise the wired limit to Metal's recommended working set for the block, then restore it.

    ``model_bytes`` (the weights) only serves a warning when the model cannot
    stay resident anyway.
    """
    if not mx.metal.is_available():
        yield
        return
    limit = mx.device_info().get("max_recommended_working_set_size", 0)
    if not limit:
        yield
        return
    if model_bytes > 0.9 * limit:
        warnings.warn(
            f"the model needs {model_bytes / 2**30:.1f} GiB, close to the {limit / 2**30:.1f} GiB "
            "Metal can keep resident: generation may be slow",
            stacklevel=3,
        )
    previous = mx.set_wired_limit(limit)
    try:
        yield
    finally:
        mx.synchronize()  # the limit must not change under a running kernel
        mx.set_wired_limit(previous)
