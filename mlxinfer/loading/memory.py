"""Memory: what the machine can give, what a model takes, and the KV budget of a generation.

Before a model loads, its weights (read from the safetensors headers, at the dtype they
will be computed in), the KV cache it will be given and a little headroom are weighed
against what the machine can give now: on a Mac, MLX's recommended working set for the GPU
less the memory MLX already holds; elsewhere ``MemAvailable`` (``/proc/meminfo``), or a
container's cgroup limit less its usage when smaller, or psutil's figure. A model that does
not fit is refused with the numbers (:class:`~mlxinfer.errors.InsufficientMemoryError`)
unless forced: paging a model in and out of memory makes it crawl, and past that the OS
kills the process (mlx-lm's unbounded KV growth panicked Macs).

While generating, a single request's KV cache is held to a budget in tokens
(:func:`kv_limit`): what the machine can give when the request starts, or the caller's
``kv_budget``. A request that reaches it ends with ``finish_reason="length"`` and
``stats.limited_by == "kv_budget"``; a prompt that cannot fit is refused before prefill.
The batch engine has its own budget (``kv_budget``, its pool).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx

from ..errors import InsufficientMemoryError
from ..platform.memory import Capacity, available

GB = 1e9
# Left free beyond weights and KV: activations of a prefill chunk, logits, the tokenizer,
# Python itself. A few hundred MB on the models this runs; not tuned.
HEADROOM = 256 << 20
# The KV a single generation is counted to need at load when the caller names no budget:
# this many tokens, or the whole context if shorter (generation then holds to what is left).
LOAD_KV_TOKENS = 4096
_FLOAT_BYTES = {"F16": 2, "BF16": 2, "F32": 4}


def capacity(working_set: int | None = None) -> Capacity | None:
    """What can be allocated now without paging: ``working_set`` (Metal's recommended working
    set, :func:`recommended_working_set`) less what MLX holds; else the
    smallest of MemAvailable, the cgroup's room and psutil's available memory; None if none
    of them can be read."""
    if working_set is not None:
        used = mx.get_active_memory()
        return Capacity(
            max(working_set - used, 0),
            f"the GPU's recommended working set is {working_set / GB:.1f} GB, "
            f"{size_text(used)} of it in use",
        )
    return available()


# --- what a model takes -------------------------------------------------------------------------


def weights_bytes(files: Iterable[Path], dtype: mx.Dtype | None) -> int:
    """The bytes the tensors of ``files`` take once loaded: as stored, or float tensors at
    ``dtype`` when the loader casts them (bfloat16 doubles in float32 on the CPU)."""
    from ..files.safetensors_check import read_header

    total = 0
    for file in files:
        for info in read_header(file).values():
            stored = info["data_offsets"][1] - info["data_offsets"][0]
            width = _FLOAT_BYTES.get(info["dtype"])
            if dtype is None or width is None:
                total += stored
            else:
                total += stored // width * dtype.size
    return total


def kv_bytes_per_token_estimate(args: Any, dtype: mx.Dtype | None) -> int:
    """One token's keys and values over every layer, from a model's arguments (before its
    weights exist): 2 × kv_heads × head_dim per layer, or MLA's latent and RoPE key. An
    estimate for the check at load; 0 where the arguments do not say."""
    layers = getattr(args, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return 0
    size = dtype.size if dtype is not None else 2
    latent = getattr(args, "kv_lora_rank", None)
    if isinstance(latent, int):
        return layers * (latent + int(getattr(args, "qk_rope_head_dim", 0) or 0)) * size
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None)
    if not isinstance(head_dim, int) and isinstance(heads, int) and heads:
        head_dim = getattr(args, "hidden_size", 0) // heads
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int)):
        return 0
    return layers * 2 * kv_heads * head_dim * size


def check_fits(what: str, parts: dict[str, int], room: Capacity | None, *, hint: str = "") -> None:
    """Raise InsufficientMemoryError unless the sum of ``parts`` (name -> bytes) fits ``room``,
    naming every number."""
    if room is None:
        return
    need = sum(parts.values())
    if need <= room.bytes:
        return
    shown = " + ".join(f"{name} {size_text(n)}" for name, n in parts.items() if n)
    raise InsufficientMemoryError(
        f"{what}: needs {size_text(need)} ({shown}), but this machine can give "
        f"{size_text(room.bytes)} ({room.source}); load it anyway with force=True (--force), "
        f"or pick a smaller or more quantized model{hint}"
    )


def size_text(n: float) -> str:
    """Bytes for a message: GB, MB or kB (powers of 1000), or plain bytes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} bytes"


# --- the KV budget of one generation ----------------------------------------------------------


@dataclass(frozen=True)
class KVCost:
    """What a model's cache takes as it holds more tokens: ``per_token`` bytes for each
    layer that keeps every token, ``windows`` (bytes a token, tokens kept) for each layer
    that keeps a window, and ``fixed`` bytes (recurrent states) whatever the length."""

    per_token: int
    windows: tuple[tuple[int, int], ...]
    fixed: int

    def bytes(self, tokens: int) -> int:
        kept = sum(b * min(tokens, size) for b, size in self.windows)
        return self.fixed + self.per_token * tokens + kept

    def tokens_within(self, budget: float) -> float:
        """The most tokens whose cache fits ``budget`` bytes (inf when the cache is bounded
        and fits)."""
        if budget == math.inf:
            return math.inf
        if self.per_token == 0:
            return math.inf if self.bytes(2**62) <= budget else self._search(budget, 2**40)
        return self._search(budget, int(budget // self.per_token) + 1)

    def _search(self, budget: float, high: int) -> int:
        low = 0  # bytes() grows with tokens: the largest n with bytes(n) <= budget
        if self.bytes(0) > budget:
            return -1
        while low < high:
            mid = (low + high + 1) // 2
            if self.bytes(mid) <= budget:
                low = mid
            else:
                high = mid - 1
        return low


# id(model) -> (a weak reference to it, {settings: KVCost}); a Module is a dict, so unhashable
_costs: dict[int, tuple[weakref.ref, dict]] = {}


def kv_cost(model, *, max_kv_size: int | None = None, kv_bits: int | None = None) -> KVCost:
    """The model's :class:`KVCost` for these cache settings, read from a one-token forward
    (each cache's ``nbytes`` after one token); computed once per model and settings."""
    from ..cache.kv import StateCache
    from ..cache.rotating import RotatingKVCache

    key = (max_kv_size, kv_bits)
    ref, known = _costs.get(id(model), (None, {}))
    if ref is None or ref() is not model:
        for stale in [k for k, (r, _) in _costs.items() if r() is None]:
            del _costs[stale]
        known = {}
        _costs[id(model)] = (weakref.ref(model), known)
    if key not in known:
        cache = model.make_cache(max_kv_size=max_kv_size, kv_bits=kv_bits)
        model(mx.array([[0]], dtype=mx.int32), cache)
        mx.eval([c.state for c in cache])
        per_token, windows, fixed = 0, [], 0
        for c in cache:
            if isinstance(c, StateCache):
                fixed += c.nbytes
            elif isinstance(c, RotatingKVCache):
                windows.append((c.nbytes, c.max_size))
            else:
                per_token += c.nbytes
        known[key] = KVCost(per_token, tuple(windows), fixed)
    return known[key]


@dataclass(frozen=True)
class KVLimit:
    """The most tokens a request's cache may hold, and the budget that sets it (for messages)."""

    tokens: float  # math.inf: no limit
    budget: float  # bytes
    source: str


def kv_limit(
    model,
    cache: list,
    kv_budget: float | None,
    *,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    draft_model=None,
) -> KVLimit:
    """The tokens a single request's cache (and a draft model's, token for token) may hold:
    ``kv_budget`` bytes, or (None) what the machine can give now less :data:`HEADROOM`, plus
    what ``cache`` (a reused prompt cache) already holds."""
    if kv_budget == math.inf:
        return KVLimit(math.inf, math.inf, "no limit")
    cost = kv_cost(model, max_kv_size=max_kv_size, kv_bits=kv_bits)
    if draft_model is not None:
        extra = kv_cost(draft_model)
        cost = KVCost(
            cost.per_token + extra.per_token,
            cost.windows + extra.windows,
            cost.fixed + extra.fixed,
        )
    if kv_budget is None:
        room = capacity(recommended_working_set())
        if room is None:
            return KVLimit(math.inf, math.inf, "no figure for this machine's memory")
        held = sum(c.nbytes for c in cache)
        budget = max(room.bytes - HEADROOM, 0) + held
        source = f"what this machine can give ({room.source}) less {HEADROOM >> 20} MB"
    else:
        budget, source = kv_budget, "kv_budget"
    return KVLimit(cost.tokens_within(budget), budget, source)


def recommended_working_set() -> int | None:
    """Bytes MLX recommends the GPU keep resident (Metal), or None where there is no such
    figure (the CPU backend)."""
    try:
        if not mx.metal.is_available():
            return None
        return int(mx.metal.device_info()["max_recommended_working_set_size"])
    except (AttributeError, KeyError, RuntimeError):
        return None
