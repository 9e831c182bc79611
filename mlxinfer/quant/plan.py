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

The plan minimises the summed cost within the budget: a knapsack solved by dynamic
programming over the budget in 4,096 units (sizes rounded up, so it always fits), then the
bytes the rounding left go to the upgrades with the best cost saved per byte.
"""

from __future__ import annotations

import math
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
# The output head, tied to the embedding or not, never goes below 4 bits in a plan (mlx-lm's
# mixed_3_6 leaves SmolLM2's tied head at 3 bits: it answers "New York"); above that, its KL
# is measured at every candidate setting, not extrapolated. Measured on SmolLM2 at 4.5 bpw
# (evaluation corpus, KLD vs float32): a fixed 6-bit floor (llama.cpp's Q6_K) 0.281, 5-bit 0.203,
# the measured choice (4-bit group 32) 0.186: the floor's bytes do more in the blocks.
HEAD_MIN_BITS = 4
# ... unless keeping it there makes the plan's predicted KL this many times the plan without
# the floor: at a budget so small that the floor starves the blocks. Gemma-3-270M at 122.4 MB
# (3.65 bits per weight, the tied head 63 % of the parameters): with the floor the head took
# 4-bit g128 (89 MB) and the blocks mostly 2 bits, predicted KL 3.00, evaluation KLD 1.874,
# top-1 46.0 %; without the floor the head took 3-bit g128: predicted 1.00, KLD 0.594, 64.9 %.
FLOOR_YIELDS = 2.0
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


def protect_head(tensors: Sequence[Tensor], budget: int) -> int | None:
    """Keep the head's candidates at :data:`HEAD_MIN_BITS` or more, unless even that cannot fit
    the budget beside every other tensor's smallest setting (then the measured costs alone
    decide). Returns the floor kept, or None."""
    others = sum(
        min(s.nbytes(t.numel) for s in t.candidates) if t.fixed is None else t.fixed.nbytes(t.numel)
        for t in tensors
        if t.role != "head"
    )
    for t in tensors:
        if t.role != "head" or t.fixed is not None:
            continue
        kept = [s for s in t.candidates if s.bits >= HEAD_MIN_BITS]
        if kept and min(s.nbytes(t.numel) for s in kept) + others <= budget:
            t.candidates = kept
            return HEAD_MIN_BITS
    return None


def choose_with_head(
    tensors: Sequence[Tensor], budget: int
) -> tuple[dict[str, Setting], int | None]:
    """:func:`choose` with the head kept at :data:`HEAD_MIN_BITS` or more (:func:`protect_head`),
    unless that plan's predicted KL is :data:`FLOOR_YIELDS` times the plan's without the floor or
    more (then the head's candidates are all kept). Returns (settings, the floor kept or None)."""
    free = choose(tensors, budget)
    heads = {id(t): list(t.candidates) for t in tensors if t.role == "head"}
    floor = protect_head(tensors, budget)
    if floor is None:
        return free, None
    kept = choose(tensors, budget)

    def predicted(settings: dict[str, Setting]) -> float:
        return sum(t.cost(settings[t.path]) for t in tensors if t.fixed is None)

    if predicted(kept) >= FLOOR_YIELDS * predicted(free):
        for t in tensors:
            if id(t) in heads:
                t.candidates = heads[id(t)]
        return free, None
    return kept, floor


def check_fits(tensors: Sequence[Tensor], budget: int) -> None:
    """Raise ConfigError when even the smallest setting of every tensor exceeds ``budget``."""
    need = sum(
        t.fixed.nbytes(t.numel) if t.fixed else min(s.nbytes(t.numel) for s in t.candidates)
        for t in tensors
    )
    if need > budget:
        raise ConfigError(
            f"size budget: expected at least {need} bytes for the quantized tensors at their "
            f"smallest settings, found a budget of {budget}"
        )


def choose(tensors: Sequence[Tensor], budget: int) -> dict[str, Setting]:
    """The settings minimising the summed cost with ``sum(bytes) <= budget``.

    Raises ConfigError when even the smallest setting of every tensor does not fit.
    """
    check_fits(tensors, budget)
    planned = [t for t in tensors if t.fixed is None]
    room = budget - sum(t.fixed.nbytes(t.numel) for t in tensors if t.fixed is not None)

    choice = _knapsack(planned, room)

    def size(choice: list[Setting]) -> int:
        return sum(s.nbytes(t.numel) for t, s in zip(planned, choice))

    left = room - size(choice)
    while True:  # spend what is left on the best cost saved per byte
        best, best_gain = None, 0.0
        for i, (t, s) in enumerate(zip(planned, choice)):
            for c in t.candidates:
                extra = c.nbytes(t.numel) - s.nbytes(t.numel)
                gain = t.cost(s) - t.cost(c)
                if 0 < extra <= left and gain > 0 and gain / extra > best_gain:
                    best, best_gain = (i, c, extra), gain / extra
        if best is None:
            break
        i, c, extra = best
        choice[i], left = c, left - extra
    plan = {t.path: s for t, s in zip(planned, choice)}
    plan.update({t.path: t.fixed for t in tensors if t.fixed is not None})
    return plan


def _knapsack(planned: Sequence[Tensor], room: int, buckets: int = 4096) -> list[Setting]:
    """One setting per tensor minimising the summed cost within ``room`` bytes: dynamic
    programming over the budget cut into ``buckets`` units (each tensor's size rounded up to
    whole units, so the plan always fits; at most a unit per tensor is left unspent, which
    the caller's greedy pass spends)."""
    unit = max(1, -(-room // buckets))
    n = room // unit
    best = np.zeros(n + 1)  # best[b]: least cost of the tensors so far within b units
    picks = []
    for t in planned:
        new = np.full(n + 1, np.inf)
        arg = np.zeros(n + 1, np.int16)
        for j, c in enumerate(t.candidates):
            w = -(-c.nbytes(t.numel) // unit)
            if w > n:
                continue
            cand = np.full(n + 1, np.inf)
            cand[w:] = best[: n + 1 - w] + t.cost(c)
            better = cand < new
            new[better], arg[better] = cand[better], j
        best = new
        picks.append(arg)
    b = int(np.argmin(best))
    if not np.isfinite(best[b]):  # fits only in exact bytes: the smallest settings
        return [min(t.candidates, key=lambda c: c.nbytes(t.numel)) for t in planned]
    choice = []
    for t, arg in zip(reversed(planned), reversed(picks)):
        c = t.candidates[int(arg[b])]
        choice.append(c)
        b -= -(-c.nbytes(t.numel) // unit)
    return choice[::-1]


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


def plan_bytes(tensors: Sequence[Tensor], plan: dict[str, Setting]) -> int:
    return sum(plan[t.path].nbytes(t.numel) for t in tensors if t.path in plan)


def budget_from_bpw(bpw: float, parameters: int, other_bytes: int) -> int:
    """Bytes for the quantized tensors so the whole weight files hold ``bpw`` bits per parameter."""
    return math.floor(bpw * parameters / 8) - other_bytes
