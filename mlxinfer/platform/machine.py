"""Facts about the machine mlxinfer runs on: its CPU's name and the user cache folder.

A leaf module: whatever names the machine next to a figure (``mlxinfer bench``,
``tools/bench_blas.py``) or keeps something per machine (the default model, the
CPU plans measured at load) reads it from here.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

CACHE_ENV = "MLXINFER_CACHE"
HOME_ENV = "MLXINFER_HOME"  # another name for it (the model store lives there)


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), for naming the machine next to its figures."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def user_cache_dir() -> Path:
    """``$MLXINFER_CACHE`` (or its other name ``$MLXINFER_HOME``), else ~/Library/Caches/mlxinfer
    (macOS) or $XDG_CACHE_HOME/mlxinfer."""
    for env in (CACHE_ENV, HOME_ENV):
        if os.environ.get(env):
            return Path(os.environ[env]).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mlxinfer"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mlxinfer"
