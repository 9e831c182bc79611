"""Rotary position embeddings, with the ``rope_scaling`` types of transformers.

Every variant runs through ``mx.fast.rope`` (a Metal kernel on a Mac). The
variants differ only in the per-pair frequencies they feed it:

- default: ``inv_freq[i] = base ** (-2i / dims)``
- linear:  positions divided by ``factor`` (``scale = 1 / factor``)
- dynamic: NTK; once the sequence outgrows ``max_position_embeddings`` the base
  grows as ``base * (factor * L / max_pos - (factor - 1)) ** (dims / (dims - 2))``
- llama3:  low frequencies divided by ``factor``, a smooth ramp between
- yarn:    per-frequency blend of interpolation and extrapolation, plus an
  attention factor that scales cos and sin (applied here to the input, which
  is the same thing since RoPE is linear).
- longrope (Phi-3's "su"): each pair's period is stretched by its own factor,
  from ``short_factor`` while the sequence fits ``original_max_position_embeddings``
  and ``long_factor`` beyond, plus an attention factor on the rotated features.

``mx.fast.rope`` takes ``freqs`` as the inverse of ``inv_freq`` (periods / 2π).
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Any, Iterator, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...errors import ConfigError

_PROMPT = threading.local()


def reach(offset: int | mx.array, n: int) -> int:
    """The furthest position + 1 that ``n`` new tokens after ``offset`` reach (for a batch's
    (B,) offsets, its furthest row's); inside :func:`prompt_reach`, at least the prompt's."""
    # cast: item() of an integer array is an int
    furthest = offset + n if isinstance(offset, int) else int(cast(int, offset.max().item())) + n
    return max(furthest, getattr(_PROMPT, "reach", 0))


@contextmanager
def prompt_reach(n: int) -> Iterator[None]:
    """While a prompt reaching ``n`` is fed in chunks (on this thread): every chunk rotates as
    one forward over the whole prompt would, the way transformers rotates it. Frequencies that
    follow the length (dynamic NTK, LongRoPE) would otherwise rotate each chunk by its own
    reach: a long prompt's first chunks by the short factors."""
    outer = getattr(_PROMPT, "reach", 0)
    _PROMPT.reach = n
    try:
        yield
    finally:
        _PROMPT.reach = outer


class RoPE(nn.Module):
    """Rotate the first ``dims`` features of (B, n_heads, L, head_dim) inputs."""

    def __init__(
        self,
        dims: int,
        base: float,
        *,
        traditional: bool = False,
        inv_freq: np.ndarray | None = None,
        scale: float = 1.0,
        input_scale: float = 1.0,
        dynamic: tuple[float, int] | None = None,
    ):
        super().__init__()
        self.dims = dims
        self.base = base
        self.traditional = traditional
        self.scale = scale
        self.input_scale = input_scale
        self.dynamic = dynamic  # (factor, max_position_embeddings) for dynamic NTK
        # A leading underscore keeps the frequencies out of the parameter tree.
        # mx.fast.rope takes periods (1 / inv_freq); a backend computing the angles itself
        # takes the frequencies as given, without a second rounding.
        self._freqs = None if inv_freq is None else mx.array(1.0 / inv_freq, dtype=mx.float32)
        self._inv_freq = None if inv_freq is None else mx.array(inv_freq, dtype=mx.float32)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.input_scale != 1.0:
            x = x * self.input_scale
        return self.rotate(x, offset, self.base_at(offset, x.shape[-2]))

    def base_at(self, offset: int | mx.array, n: int) -> float:
        """The base that ``n`` tokens after ``offset`` rotate with (dynamic NTK grows it)."""
        if self.dynamic is None:
            return self.base
        factor, max_pos = self.dynamic
        seq_len = self.regime(reach(offset, n))
        assert seq_len is not None  # dynamic NTK's regime is a length
        return self.base * ((factor * seq_len / max_pos) - (factor - 1)) ** (
            self.dims / (self.dims - 2)
        )

    def regime(self, reach: int) -> int | None:
        """What the frequencies depend on for a sequence reaching ``reach`` (its furthest
        position + 1): nothing (None), or dynamic NTK's length, which is
        ``max_position_embeddings`` until the sequence outgrows it. A batch's rows with the same
        regime rotate alike, so they share a forward."""
        if self.dynamic is None:
            return None
        return max(reach, self.dynamic[1])

    def rotate(self, x: mx.array, offset: int | mx.array, base: float) -> mx.array:
        """The rotation itself: ``mx.fast.rope`` (one Metal kernel); a backend may replace it."""
        if self._freqs is not None:
            return mx.fast.rope(
                x,
                self.dims,
                traditional=self.traditional,
                base=None,
                scale=self.scale,
                offset=offset,
                freqs=self._freqs,
            )
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=base, scale=self.scale, offset=offset
        )


def make_rope(
    dims: int,
    base: float,
    scaling: dict[str, Any] | None,
    max_position_embeddings: int,
    traditional: bool = False,
) -> RoPE | LongRoPE:
    """Build the RoPE a config asks for (``scaling`` is normalised ``rope_scaling``)."""
    if scaling is None:
        return RoPE(dims, base, traditional=traditional)
    kind = scaling["rope_type"]
    factor: Any = scaling.get("factor")  # a number (config_check) where the kind needs one
    if kind in ("linear", "dynamic", "llama3") and factor is None:
        raise ConfigError(f"config.json: rope_scaling type '{kind}' needs key 'factor'")
    if kind == "linear":
        return RoPE(dims, base, traditional=traditional, scale=1.0 / factor)
    if kind == "dynamic":
        return RoPE(
            dims, base, traditional=traditional, dynamic=(float(factor), max_position_embeddings)
        )
    inv_freq = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
    if kind == "llama3":
        return RoPE(
            dims, base, traditional=traditional, inv_freq=_llama3_inv_freq(inv_freq, scaling)
        )
    if kind == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(dims, base, scaling, max_position_embeddings)
        return RoPE(
            dims, base, traditional=traditional, inv_freq=inv_freq, input_scale=attention_factor
        )
    if kind in ("longrope", "su"):
        return LongRoPE(dims, base, scaling, max_position_embeddings, traditional=traditional)
    raise ConfigError(
        f"config.json: unsupported rope_scaling type '{kind}' "
        "(expected one of default, linear, dynamic, llama3, yarn, longrope)"
    )


def _llama3_inv_freq(inv_freq: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are interpolated, short ones kept,
    # and the band between is a linear blend in 1/wavelen.
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, scaled)


def _yarn_inv_freq(
    dims: int, base: float, s: dict[str, Any], max_pos: int
) -> tuple[np.ndarray, float]:
    original = s.get("original_max_position_embeddings") or max_pos
    factor = s.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The pair index whose wavelength fits `rotations` times in the original context.
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dims, 2, dtype=np.float32) / dims)
    extrapolate = 1 - ramp  # 1 where the pair keeps its original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


class LongRoPE(nn.Module):
    """LongRoPE: per-pair frequency factors, short or long by the sequence length.

    Like transformers, the choice is made per forward pass from the last
    position it reaches (``offset + L``), so keys cached while the sequence was
    short keep their short-factor rotation. ``dims`` may be less than the head
    size (partial rotary); the attention factor scales only the rotated part.
    """

    def __init__(
        self,
        dims: int,
        base: float,
        s: dict[str, Any],
        max_position_embeddings: int,
        traditional: bool = False,
    ):
        super().__init__()
        for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
            if s.get(key) is None:
                raise ConfigError(f"config.json: rope_scaling type 'longrope' needs key '{key}'")
        if len(s["short_factor"]) != dims // 2 or len(s["long_factor"]) != dims // 2:
            raise ConfigError(
                f"config.json: rope_scaling 'short_factor'/'long_factor' must have {dims // 2} "
                f"entries, found {len(s['short_factor'])}/{len(s['long_factor'])}"
            )
        self.dims, self.traditional = dims, traditional
        self.original_max = s["original_max_position_embeddings"]
        factor = s.get("factor") or max_position_embeddings / self.original_max
        attention_factor = s.get("attention_factor")
        if attention_factor is None:
            attention_factor = (
                1.0
                if factor <= 1
                else math.sqrt(1 + math.log(factor) / math.log(self.original_max))
            )
        self.attention_factor = float(attention_factor)
        periods = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)  # 1 / inv_freq
        # Underscores keep the tables out of the parameter tree.
        self._short = mx.array(np.asarray(s["short_factor"]) * periods, dtype=mx.float32)
        self._long = mx.array(np.asarray(s["long_factor"]) * periods, dtype=mx.float32)

    def regime(self, reach: int) -> bool:
        """Whether a sequence reaching ``reach`` rotates with the long factors (see
        :meth:`RoPE.regime`)."""
        return reach > self.original_max

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        freqs = self._long if self.regime(reach(offset, x.shape[-2])) else self._short
        out = mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=freqs,
        )
        if self.attention_factor == 1.0:
            return out
        if self.dims == x.shape[-1]:
            return out * self.attention_factor
        rotated, passed = out[..., : self.dims], out[..., self.dims :]
        return mx.concatenate([rotated * self.attention_factor, passed], axis=-1)
