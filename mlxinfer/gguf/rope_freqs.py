"""Llama 3.1+'s RoPE scaling from a GGUF file's ``rope_freqs.weight``.

llama.cpp's converter (conversion/llama.py, ``generate_extra_tensors``) does not write a Llama
3.1/3.2/3.3 checkpoint's ``rope_scaling`` (``rope_type: llama3``, ``factor``,
``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``) as metadata:
it writes the factor each rotation frequency is divided by, one per pair of the head. Those
factors are 1 for short wavelengths, ``factor`` for long ones, and ``1 / ((1 - s) / factor + s)``
between, with ``s = (old / wavelength - low) / (high - low)`` linear in 1 / wavelength. The
function depends on the four settings only through ``factor`` and that line, so we read the
line off the factors between (taking ``low = 1``, as every Llama 3 has it), and keep the result
only if it gives every factor of the file again; a file whose factors are of another form is a
WeightsError naming the tensor.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..errors import WeightsError


def _factors(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """The frequency divisors these llama3 settings give (llama.cpp's computation)."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
    ramp = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, ramp))


def llama3_scaling(path: Path, factors: np.ndarray, base: float, dims: int) -> dict | None:
    """HF's ``rope_scaling`` for these per-pair frequency divisors (None: all 1)."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape != (dims // 2,):
        raise WeightsError(
            f"{path}: tensor rope_freqs.weight has {factors.size} values; expected {dims // 2} "
            "(one per pair of the head)"
        )
    if not (np.isfinite(factors).all() and (factors >= 1 - 1e-6).all()):
        bad = factors[~(np.isfinite(factors) & (factors >= 1 - 1e-6))][0]
        raise WeightsError(
            f"{path}: tensor rope_freqs.weight: expected finite divisors of at least 1, found {bad}"
        )
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    inv_freq = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    between = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    # s for each factor between, then the line s = a / wavelength + b through them
    s = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
    if between.sum() >= 2:
        a, b = np.polyfit(1 / wavelen[between], s, 1)
    else:  # one point or none: the line through it with Llama 3's high_freq_factor of 4
        b = -1 / 3
        if between.any():
            a = float((s[0] - b) * wavelen[between][0])
        else:  # no pair between: old / 4 and old / 1 fall in the gap between the two kinds
            a = float(-b * wavelen[factors > 1 + 1e-6].min() * 0.999)
    if b >= 0 or a <= 0:
        raise WeightsError(f"{path}: tensor rope_freqs.weight: not Llama 3's frequency scaling")
    high = 1 - 1 / b
    scaling = {
        "rope_type": "llama3",
        "factor": float(np.float32(factor)),
        "low_freq_factor": 1.0,
        "high_freq_factor": float(f"{high:.6g}"),
        "original_max_position_embeddings": int(round(-a / b)),
    }
    if not np.allclose(_factors(inv_freq, scaling), factors, rtol=1e-4, atol=0):
        raise WeightsError(
            f"{path}: tensor rope_freqs.weight: expected the factors of Llama 3's frequency "
            f"scaling, found values no such setting gives ({factors[:4].tolist()}...)"
        )
    return scaling
