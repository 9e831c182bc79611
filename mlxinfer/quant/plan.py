"""Per-tensor bits and group sizes under a size budget, from measured costs (issue 48, item 5).

For every tensor a recipe may quantize, each candidate setting ``c`` (bits 2-8 x group
32/64/128) has a size ``bytes_t(c)`` (packed codes plus a 16-bit scale and bias per group)
and a cost: how much it raises the KL divergence of the model's output from the float model's
on calibration tokens. Measuring every (tensor, setting) pair is a forward pass each, so:

* the *shape* of a tensor's cost over settings is the importance-weighted squared error
  ``e_t(c) = sum_k imp_k * sum_rows (W - Q_c(W))**2`` (``imp_k`` the mean ``x_k**2`` of the
  calibration tokens: ``E ||(W - Q_c(W)) x||**2`` when channels are uncorrelated), cheap for
  every candidate;
* its *scale* is measured: the tensor alone is quantized at a probe setting and the model's
  KL divergence on calibration tokens is taken, ``alpha_t = KL_t / e_t(probe)``. KL grows with
  the square of a small output change, so in proportion to ``e_t``;
* cost ``alpha_t * e_t(c)``; the costs of different tensors add (small independent changes).
  The output head (or the tied embedding) matters most and is one tensor: its KL is measured
  at every candidate setting instead.

The settings within a budget that minimise the summed cost: :mod:`mlxinfer.quant.budget`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ConfigError

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
PROBE = (3, 64)  # the setting each tensor's sensitivity is measured at
RECIPE_HEAD_BITS = 6  # the named recipes keep llama.cpp's Q6_K head
SCALE_BYTES = 2  # a planned layer's scales and biases are stored as 16-bit floats


@dataclass(frozen=True)
class Setting:
    bits: int
    group_size: int

    def nbytes(self, numel: int, scale_bytes: int = SCALE_BYTES) -> int:
        return numel * self.bits // 8 + 2 * scale_bytes * (numel // self.group_size)

    def __str__(self) -> str:
        return f"{self.bits}-bit g{self.group_size}"


@dataclass
class Tensor:
    """One quantizable tensor: its module path, module, role and candidates' measured figures."""

    path: str
    module: nn.Module
    role: str  # "head", "embedding" (input only), "experts" or "linear"
    candidates: list[Setting] = field(default_factory=list)
    errors: dict[Setting, float] = field(default_factory=dict)  # e_t(c)
    alpha: float = 1.0  # KL per unit of e_t, measured at PROBE
    fixed: Setting | None = None  # a --tensor-bits override: not planned

    @property
    def numel(self) -> int:
        return int(self.module.weight.size)

    def cost(self, s: Setting) -> float:
        return self.alpha * self.errors.get(s, 0.0)


def quantizable(model: nn.Module, rule: Callable | None = None) -> list[Tensor]:
    """The tensors a recipe may quantize: float layers with ``to_quantized`` whose input width
    is a multiple of 32 and that the family's ``quant_predicate`` allows."""
    head = getattr(model, "head", None)
    out = []
    for path, m in model.named_modules():
        if not hasattr(m, "to_quantized") or "scales" in m or "weight" not in m:
            continue
        if m.weight.shape[-1] % GROUP_SIZES[0] or (rule is not None and not rule(path, m)):
            continue
        if m is head or path.endswith("lm_head"):
            role = "head"
        elif isinstance(m, nn.Embedding):
            role = "embedding"
        elif m.weight.ndim == 3:
            role = "experts"
        else:
            role = "linear"
        cands = [Setting(b, g) for b in BITS for g in GROUP_SIZES if m.weight.shape[-1] % g == 0]
        out.append(Tensor(path, m, role, cands))
    return out


# Elements rounded at a time: min/max rounding's temporaries are about four times its input
# (SmolLM2's 49,152 x 576 float32 embedding at 3 bits: 467 MB for its 113 MB), so a larger
# tensor is rounded a chunk of rows at a time.
CHUNK = 1 << 22


def _chunks(w: mx.array) -> list[slice]:
    """Slices of ``w``'s first axis of about :data:`CHUNK` elements each (one for a small
    tensor). Quantization groups lie along the last axis, so chunks round as the whole does."""
    if w.ndim < 2 or w.size <= CHUNK:
        return [slice(None)]
    n = max(1, CHUNK // (w.size // w.shape[0]))
    return [slice(i, i + n) for i in range(0, w.shape[0], n)]


def _rounded(w: mx.array, s: Setting) -> mx.array:
    q = mx.quantize(w, group_size=s.group_size, bits=s.bits)
    return mx.dequantize(*q, group_size=s.group_size, bits=s.bits).astype(w.dtype)


def fake_quantized(w: mx.array, s: Setting) -> mx.array:
    """``w`` after a min/max quantization at ``s`` and back: what the quantized layer multiplies.
    A large tensor is rounded a chunk at a time, each chunk evaluated before the next."""
    chunks = _chunks(w)
    if len(chunks) == 1:
        return _rounded(w, s)
    parts = []
    for c in chunks:
        parts.append(_rounded(w[c], s))
        mx.eval(parts[-1])
    return mx.concatenate(parts, axis=0)


def weighted_error(w: mx.array, s: Setting, importance: np.ndarray | None) -> float:
    """``sum_k imp_k * sum_rows (w - Q_s(w))**2`` (importance per input channel, or per
    (expert, channel)); None: unweighted. Summed a chunk of rows at a time."""
    imp = None if importance is None else mx.array(importance, mx.float32)
    total = 0.0
    for c in _chunks(w):
        part = w[c]
        d = mx.square(_rounded(part, s).astype(mx.float32) - part.astype(mx.float32))
        if imp is None:
            total += float(d.sum())
        elif imp.ndim == 2 and d.ndim == 3:  # (E, K) against (E, N, K)
            total += float((d.sum(axis=-2) * imp[c]).sum())
        else:
            total += float((d.sum(axis=tuple(range(d.ndim - 1))) * imp).sum())
    return total


def probe_setting(t: Tensor) -> Setting:
    """The setting ``t``'s sensitivity is measured at: PROBE, or for inputs too narrow for its
    group, the same bits at the candidate group nearest to it (every candidate has group 32)."""
    near = [s for s in t.candidates if s.bits == PROBE[0]]
    return min(near, key=lambda s: (abs(s.group_size - PROBE[1]), s.group_size))


def measure(
    tensors: Sequence[Tensor],
    importance: Callable[[str], np.ndarray | None],
    probe_kl: Callable[[Tensor, Setting], float] | None,
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> None:
    """Fill each tensor's ``errors`` and (with ``probe_kl(tensor, setting)``, the model's KL
    with that one tensor quantized at that setting) its measured ``alpha``;
    ``progress("measuring tensors", done, total)`` after each."""
    for i, t in enumerate(tensors):
        if t.fixed is None:
            measure_errors(t, importance(t.path), probed=probe_kl is not None)
            if probe_kl is not None:
                set_alpha(t, {s: probe_kl(t, s) for s in probe_settings(t)})
        if progress is not None:
            progress("measuring tensors", i + 1, len(tensors))


def probe_settings(t: Tensor) -> list[Setting]:
    """The settings ``t``'s KL is measured at: every candidate for the head (and a tied
    embedding), else :func:`probe_setting`."""
    return list(t.candidates) if t.role == "head" else [probe_setting(t)]


def measure_errors(t: Tensor, importance: np.ndarray | None, *, probed: bool = True) -> None:
    """``t.errors``: the weighted error at every candidate (a probed head's errors are its
    measured KLs instead, set by :func:`set_alpha`)."""
    if t.role == "head" and probed:
        return
    w = t.module.weight
    for s in t.candidates:
        t.errors[s] = weighted_error(w, s, importance)


def set_alpha(t: Tensor, kls: dict[Setting, float]) -> None:
    """From the measured KLs at :func:`probe_settings`: the head's errors are its KLs (alpha
    1), another tensor's alpha is its KL per unit of weighted error at the probe setting."""
    if t.role == "head":
        t.alpha = 1.0
        t.errors = {s: max(kls[s], 0.0) for s in t.candidates}
        return
    probe = probe_setting(t)
    e = t.errors[probe]
    t.alpha = max(kls[probe], 0.0) / e if e > 0 else 0.0


def parse_overrides(specs: Sequence[str]) -> list[tuple[re.Pattern, Setting]]:
    """``PATTERN=BITS[:GROUP]`` (llama.cpp's ``--tensor-type``): a regular expression searched
    in each module path, and the setting it forces (group 64 when not given)."""
    out = []
    for spec in specs:
        pattern, sep, value = spec.rpartition("=")
        bits, _, group = value.partition(":")
        try:
            s = Setting(int(bits), int(group or 64))
            regex = re.compile(pattern)
        except (ValueError, re.error) as e:
            raise ConfigError(
                f"--tensor-bits {spec!r}: expected PATTERN=BITS[:GROUP], found an error ({e})"
            ) from None
        if not sep or not pattern or s.bits not in BITS or s.group_size not in GROUP_SIZES:
            raise ConfigError(
                f"--tensor-bits {spec!r}: expected PATTERN=BITS[:GROUP] with bits in {BITS} and "
                f"group in {GROUP_SIZES}"
            )
        out.append((regex, s))
    return out


def apply_overrides(tensors: Sequence[Tensor], overrides) -> None:
    for t in tensors:
        for regex, s in overrides:
            if regex.search(t.path):
                if t.module.weight.shape[-1] % s.group_size:
                    raise ConfigError(
                        f"--tensor-bits {regex.pattern}: {t.path} has {t.module.weight.shape[-1]} "
                        f"inputs, not a multiple of group {s.group_size}"
                    )
                t.fixed = s
                break


# --- named recipes -------------------------------------------------------------------------


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third
    one between get the larger type (Q4_K_M's attn_v and ffn_down)."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _layer_index(path: str) -> int | None:
    m = re.search(r"\.(?:layers|h|blocks)\.(\d+)\.", path)
    return int(m.group(1)) if m else None


def recipe_settings(name: str, tensors: Sequence[Tensor]) -> dict[str, Setting]:
    """Settings of a named recipe for each tensor.

    ``q4_k_m``: shaped like llama.cpp's Q4_K_M in MLX's format: 4-bit group 64 (4.5 bits a
    weight with 16-bit scales, like Q4_K), attention values and MLP down projections at 6 bits
    in the layers ``use_more_bits`` picks, the head (tied or not) at 6 bits.
    ``q3_k_m``: the same shape at 3/5 bits (5-bit attention values, MLP down at 4 bits).
    """
    recipes = {"q4_k_m": (4, 6, 6), "q3_k_m": (3, 5, 4)}
    if name not in recipes:
        raise ConfigError(f"--recipe: expected one of {', '.join(recipes)}, found {name!r}")
    base, more, down = recipes[name]
    layers = [i for t in tensors if (i := _layer_index(t.path)) is not None]
    n_layers = max(layers) + 1 if layers else 1
    out = {}
    for t in tensors:
        i = _layer_index(t.path)
        bits = base
        if t.role == "head":
            bits = RECIPE_HEAD_BITS
        elif i is not None and _more_bits(i, n_layers):
            if re.search(r"(v_proj|attn\.c_attn|value)$", t.path):
                bits = more
            elif re.search(r"down_proj|w2|c_proj$|fc2$", t.path):
                bits = max(down, more if name == "q4_k_m" else down)
        g = 64 if t.module.weight.shape[-1] % 64 == 0 else 32
        out[t.path] = t.fixed or Setting(bits, g)
    return out
