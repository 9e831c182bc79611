"""What the benchmark's modules share: the engines, the metrics, the error."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import MlxInferError

ENGINES = ("mlxinfer", "mlx-lm")
METRICS = ("prefill_tps", "decode_tps", "ttft_s", "peak_memory_gb")
Log = Callable[[str], None]


class BenchError(MlxInferError):
    """The mlx-lm child process failed or printed no results."""


@dataclass
class Run:
    """One timed generation (either engine)."""

    ttft_s: float
    prefill_tps: float
    decode_tps: float
    peak_memory_gb: float
    total_s: float = float("nan")  # wall time of the whole run (batch runs)
