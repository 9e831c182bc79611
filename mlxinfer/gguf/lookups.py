"""Typed lookups of one architecture's GGUF metadata, and the bounds on what they may ask for.

Shared by arch_config.py (the keys every architecture has) and arch_families.py (each
family's own): a wrong type or range is a ConfigError naming the key, a needed key that is
absent a WeightsError (metadata.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ConfigError, WeightsError
from . import metadata as meta


def f32(x) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


# Bounds on what a file's metadata may ask for: far above every published model (Llama 3.1
# 405B: 126 layers, 16384 wide, 128 heads; Kimi K2: 384 experts; Llama 4 Scout: 10M tokens of
# context), low enough that nothing sized from them (per-layer lists, RoPE tables, a KV
# budget) is a hostile allocation. Every tensor's own size is bounded by the file.
MAX_LAYERS = 1 << 12
MAX_WIDTH = 1 << 20  # hidden, FFN, head and window sizes
MAX_HEADS = 1 << 12
MAX_CONTEXT = 1 << 26
MAX_EXPERTS = 1 << 16
MAX_VOCAB = 1 << 24
MAX_ROPE = 1e12  # rope.freq_base, scaling factors, YaRN betas


class Meta:
    """Typed metadata lookups under the architecture's prefix (metadata.py): a wrong type or
    range is a ConfigError naming the key; a needed key that is absent, a WeightsError."""

    def __init__(self, path: Path, md: dict, arch: str, read=None):
        self.path, self.md, self.arch = path, md, arch
        self.read = read  # a tensor's values as float32 (GGUFTensor -> ndarray), or None

    def integer(self, key: str, *, lo: int = 1, hi: int, default=meta.REQUIRED) -> int:
        return meta.integer(self.path, self.md, f"{self.arch}.{key}", lo=lo, hi=hi, default=default)

    def number(self, key: str, *, hi: float = MAX_ROPE, default=meta.REQUIRED) -> float:
        return meta.number(self.path, self.md, f"{self.arch}.{key}", hi=hi, default=default)

    def string(self, key: str, default=meta.REQUIRED) -> str | None:
        return meta.string(self.path, self.md, f"{self.arch}.{key}", default=default)

    def flag(self, key: str, default: bool) -> bool:
        return meta.boolean(self.path, self.md, f"{self.arch}.{key}", default=default)

    def error(self, key: str, expected: str, found) -> ConfigError:
        return ConfigError(f"{self.path}: {self.arch}.{key}: expected {expected}, found {found}")


def rope_scaling(m: Meta, **yarn_defaults) -> dict | None:
    """``rope.scaling.*`` as HF's ``rope_scaling`` (none, linear or yarn)."""
    kind = m.string("rope.scaling.type", default=None)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": f32(m.number("rope.scaling.factor"))}
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": f32(m.number("rope.scaling.factor", default=1.0)),
        }
        original = m.integer("rope.scaling.original_context_length", hi=MAX_CONTEXT, default=None)
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        for key in ("beta_fast", "beta_slow"):
            value = m.number(f"rope.scaling.yarn_{key}", default=yarn_defaults.get(key))
            if value is not None:
                scaling[key] = f32(value)
        return {**yarn_defaults, **scaling}
    raise WeightsError(
        f"{m.path}: {m.arch}.rope.scaling.type={kind!r:.80} not supported "
        "(expected none, linear or yarn)"
    )


def kv_heads_per_layer(m: Meta, n_heads: int) -> list[int] | None:
    """``attention.head_count_kv`` where a file gives it per layer (LFM2: 0 for a convolution
    layer), else None; every entry 0..n_heads, one at least not 0."""
    raw = m.md.get(f"{m.arch}.attention.head_count_kv")
    if not isinstance(raw, (list, np.ndarray)):
        return None
    values = np.asarray(raw).reshape(-1)
    if (
        values.dtype.kind not in "iu"
        or len(values) > MAX_LAYERS
        or not ((values >= 0) & (values <= n_heads)).all()
        or not values.any()
    ):
        raise m.error("attention.head_count_kv", f"per-layer counts in 0..{n_heads}, one not 0",
                      f"{raw!r:.80}")  # fmt: skip
    return [int(v) for v in values]
