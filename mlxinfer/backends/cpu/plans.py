"""Which of the CPU backend's decode plans pay on this machine: measured, not assumed.

The plans (``parallel``) spread a decode step's one-row products over two CPU
streams. Tuned on one machine they paid well; on another they made decode slower
(docs/performance.md). So each is a *choice*, and
at load :func:`choose` times the model's own decode step under each option,
keeping an option only if it beats the plainer one by 3%:

- ``cut``: large float Linears cut by rows over the two streams, or one call;
- ``halves``: float gated MLPs as two half MLPs side by side, or one MLP;
- ``head``: the float LM head in blocks over the two streams, one product, or one call of the
  compiled kernel (``kernel``, where the kernels are loaded: ``compiled``);
- ``fuse``: siblings (q/k/v, gate/up; float, or quantized of one format) as one stacked product,
  or one product each (``fused``);
- ``quantized``: quantized layers in one call, cut in halves over the two streams, with
  siblings (q/k/v, gate/up) whole side by side, or side by side with the largest cut to
  balance the streams (``parallel.plan_siblings``), or the compiled kernel in one call
  (``kernel``: affine 2/3/4/5/6/8-bit layers, a quantized tied head included);
- ``matvec`` (kernels loaded): the blocks' float32 Linears through MLX's matmul (``blas``:
  the plans above) or the compiled kernel (``kernel``, which has a split MLP's down projection
  hold its weight as (out, in) again, so that MLP runs whole);
- ``kernel_threads`` (kernels loaded, timed only if a ``kernel`` option won): the kernels'
  pool on ``all`` the CPUs the process may use, or ``one`` thread (on a loaded 2-core machine
  one beat two). A layer on a kernel never takes the two-stream split, so the pool and
  MLX's two worker streams do not ask for more threads than there are cores;
  a model too slow for every plan to be timed (``timing.MAX_MEASURE_S``) still has its
  ``kernel`` options timed, against the plainest option alone;
- ``decode`` (kernels loaded): a decode step's RMSNorms, plain RoPE attention and SwiGLU
  through MLX's ops (``ops``: the norm's three primitives, RoPE, the cache write and
  attention's ~thirty, SwiGLU's one to three) or one compiled kernel each (``kernel``:
  ``compiled.rms_norm`` and ``compiled.swiglu`` for up to 16 rows,
  ``attention_kernels.decode_attention`` for one token over a plain ``KVCache``);
- ``int16_decode`` (kernels loaded, AVX-512 VNNI and VBMI, affine quantized layers): decode's
  quantized products (the blocks' kernels, the head, the batching engine's rows) in float32
  (``float``) or with x rounded to int16 per block of 32 (``int16``: ``compiled.set_int16_decode``;
  process-wide, as the kernels' threads): 4-, 5-, 6- and 8-bit layers with 32-multiple outputs through
  tiled copies of their codes made at first use (``tiles``: 0.5-1 byte a weight more memory while
  the plan is on), other widths' products of up to 4 rows through the int16 product's few-row
  path; timed on whole decode steps;
- ``long_keys``: from how many cached keys decode attention takes its long-context
  form (``ops._attend``), timed on the model's attention shapes alone;
- ``dequantize_rows``: from how many rows a quantized layer dequantizes its weight for
  a BLAS product instead of its few-row product (the compiled kernel where ``quantized=kernel``,
  for every row count below this one, else MLX's quantized kernel; short prompts, batched
  prefill, speculative verification), timed on the model's largest quantized layer alone;
- ``int16_rows`` (kernels loaded, AVX-512 VNNI and VBMI): from how many rows a quantized
  layer's product takes the int16 kernel (``compiled.int16_product``: x rounded to int16 per
  block of 32 inputs, no dequantized weight) instead of the product ``dequantize_rows`` gives it,
  timed on the model's largest quantized layer alone; never where it does not run;
- ``int16_head`` (the same): up to how many rows (0: none) a quantized tied LM head's few-row
  products (decode, the batching engine's steps) take the int16 kernel's few-row path (each
  output row's codes against x's int16 blocks, the next rows' lines prefetched) instead of the
  quantized kernel, timed on the head alone at 1, 2, 4, 8 and 16 rows while it wins;
- ``dequantized_attention``: from how many queries attention over a quantized KV cache
  (``--kv-bits``) dequantizes it instead of multiplying it packed, timed on the model's
  attention shapes alone;
- ``small``: from how many elements the softmax and SwiGLU use the fast exponential's
  kernels instead of MLX's own ops, timed on SwiGLU alone (short prompts).
- ``pad_rows``: from how many rows (of fewer than 16) a float product runs padded to 16 rows
  (``ops.padded_product``: OpenBLAS's sgemm is not monotonic in the rows; batched decode,
  speculative verification, short prompts), timed on the blocks' largest float weight alone.

The kinds, their options and the layers they act on are in ``kinds``; the
timing in ``timing``; this module chooses, caches and reads the setting. The
choices are made one after the other (each with the ones before it settled),
in interleaved rounds, in about half a second for SmolLM2. The answer is cached in
the user cache (``cpu-plans.json``), keyed by the CPU, the number of CPUs, MLX,
the BLAS, the kernels (none, or their instruction set and usable CPUs) and the model's
shapes, so the timing runs once per machine and model.

The choice is timed with the machine watched (``quiet``): a choice timed while other work
kept more than a quarter of the CPUs busy is used for that run but not cached. Before it is
kept, the measured plans are timed as a whole against the static default (the kernels where
they exist, else one stream: ``timing.static_default``) and kept only if 3% faster. Each
cached entry records when it was timed (``-v`` shows it); ``MLXINFER_CPU_PLANS=replan`` (``mlxinfer
bench --replan``) times the plans again and replaces the entry.

``MLXINFER_CPU_PLANS`` skips the measurement: ``off`` (every plan at its
plainest: one stream, MLX's ops, no kernel, no long-context form), ``on`` (every
two-stream plan at its most parallel, MLX's ops, no kernel, long-context form from
``ops.DECODE_LONG_KEYS`` keys), ``single`` (as ``off``, but every layer the compiled kernels
cover on them: one MLX stream, what a distributed load sets), ``kernels`` (as ``on``, but every
layer the compiled
kernels cover on them, on all usable CPUs), or a list such as
``cut=two,halves=one,quantized=kernel,kernel_threads=one,long_keys=2048`` (the kinds not
named are measured). A ``kernel`` option where the kernels are not loaded is the ``one`` /
``blas`` path.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ...files import entries
from ...platform.blas import preloaded_blas
from ...platform.machine import cpu_name, user_cache_dir
from . import compiled, quiet, tiles
from .choices import attention_shapes
from .kinds import (
    KERNELS,
    MOST_PARALLEL,
    NEVER,
    NUMERIC,
    OPTIONS,
    THRESHOLDS,
    attention_layers,
    current,
    exponential_users,
    numeric_kinds,
    plan_layers,
    quantized_linears,
    set_plan,
    set_plans,
)
from .timing import confirm, measure

__all__ = [
    "KERNELS",
    "MOST_PARALLEL",
    "NEVER",
    "NUMERIC",
    "OPTIONS",
    "attention_layers",
    "choose",
    "current",
    "exponential_users",
    "forced_plans",
    "numeric_kinds",
    "plan_layers",
    "quantized_linears",
    "set_plan",
    "set_plans",
]

ENV = "MLXINFER_CPU_PLANS"
# of the cached entries: bump when the kinds or options change (15: timed with the machine
# watched and the choice confirmed against the static default; entries of 14 may hold a choice
# timed on a busy machine, so they are timed again; 16: a quantized layer on the kernel takes
# it up to dequantize_rows, which 15 timed against MLX's loop from 17 rows on; 17: the
# kernel's several-row AVX-512 loop changed, which moves dequantize_rows' crossover; 18: one
# row of 8-bit codes (a tied head) got 1.7x faster on x86, which the kernel-or-not choices time;
# 19: the dequantized product's weight comes from the kernels' dequantize, 4-7x faster, which
# moves dequantize_rows' crossover down; 20: int16_rows, the int16 product with AVX-512 VNNI;
# 21: int16_head, a tied head's decode rows through the int16 kernel; 22: int16_decode; 23:
# int16_decode's ``int16`` tiles 4- and 8-bit layers at load, 1.3-2x faster products; 24: and
# 5- and 6-bit ones)
VERSION = 24


def cache_key(model: nn.Module) -> str:
    """The machine, MLX, the BLAS, the kernels and the shapes the plans act on."""
    shapes = sorted(
        (kind, type(m).__name__, tuple(m[k].shape), str(m[k].dtype))
        for kind, found in plan_layers(model).items()
        for m in found
        for k in ("weight", "weight_t")
        if k in m
    )
    parts = [
        VERSION,
        cpu_name(),
        os.cpu_count(),
        mx.__version__,
        preloaded_blas(),
        compiled.key(),
        shapes,
        attention_shapes(model) and [str(s) for s in attention_shapes(model)],
    ]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def cache_path() -> Path:
    return user_cache_dir() / "cpu-plans.json"


def forced_plans(value: str | None = None) -> dict[str, str | int] | None:
    """What ``value`` (by default ``MLXINFER_CPU_PLANS``) fixes: None (measure all), or
    {kind: option}."""
    value = (os.environ.get(ENV, "measure") if value is None else value).strip()
    if value in ("", "measure", "replan"):  # replan: measured again, cached entry or not
        return None
    defaults = {kind: default for kind, (_, _, default) in THRESHOLDS.items()}
    if value == "off":
        plainest = {kind: options[0] for kind, options in OPTIONS.items()}
        return {**plainest, **defaults, "long_keys": NEVER}
    if value == "on":
        return {**MOST_PARALLEL, **defaults}
    if value == "kernels":
        return {**KERNELS, **defaults}
    if value == "single":  # as off, but the kernels (one MLX stream: a distributed run's)
        plainest = {kind: options[0] for kind, options in OPTIONS.items()}
        kernels = {kind: "kernel" for kind in ("head", "quantized", "matvec", "decode")}
        return {**plainest, **kernels, **defaults, "long_keys": NEVER}
    plans: dict[str, str | int] = {}
    for item in value.split(","):
        kind, _, option = item.strip().partition("=")
        if kind in NUMERIC and option.isdigit():
            plans[kind] = int(option)
        elif kind in OPTIONS and option in OPTIONS[kind]:
            plans[kind] = option
        else:
            kinds = "; ".join(f"{k}: {'/'.join(o)}" for k, o in OPTIONS.items())
            raise ValueError(
                f"{ENV}={value!r}: expected 'on', 'off', 'single', 'kernels', 'measure', 'replan' or "
                f"kind=option items ({kinds}; {', '.join(NUMERIC)}: a number), found {item!r}"
            )
    return plans


def choose(model: nn.Module, *, log=None) -> dict[str, str | int]:
    """Set the decode plans to what is fastest on this machine for this model; returns them."""
    if getattr(model, "encoder_only", False):  # no decode step to time (BERT: embeddings only)
        return {}
    found = plan_layers(model)
    if not any(found.values()) and not attention_layers(model):
        return {}
    fixed = forced_plans()
    complete = fixed is not None and all(k in fixed for k in OPTIONS if found[k])
    if complete and all(k in fixed for k in numeric_kinds(model)):
        plans = {k: v for k, v in fixed.items() if k in numeric_kinds(model) or found.get(k)}
        set_plans(model, plans)
        return plans
    replan = os.environ.get(ENV, "").strip() == "replan"
    key = cache_key(model)
    entry = read_entries().get(key) if fixed is None and not replan else None
    if not isinstance(entry, dict) or not isinstance(entry.get("plans"), dict):
        with quiet.Watch() as watch, tiles.kept():  # int16_decode's tiles made once
            entry = measure(model, fixed)
            if fixed is None:
                entry = confirm(model, entry)
        entry["timed_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        entry["others_load"] = watch.others
        # A choice timed while other work ran is used for this run and timed again next load.
        if fixed is None and not watch.busy:
            store_entry(key, entry)
        if log is not None:
            if watch.busy:
                how = (f"timed on a busy machine, other work on {watch.others:.0%} of the CPUs: "
                       "used for this run only, timed again next load")  # fmt: skip
            else:
                how = "timed here, once" if fixed is None else "timed here"
            log(f"CPU decode plans ({how}): {describe(entry)}")
    model.cpu_plans_timed = entry.get("timed_at")  # for -v (cli/options.py)
    set_plans(model, entry["plans"])
    return dict(entry["plans"])


def describe(entry: dict) -> str:
    parts = []
    skipped = entry.get("seconds", {}).get("skipped")
    if skipped:
        what = "only the kernels timed" if skipped.get("kernels_timed") else "not timed"
        parts.append(f"{what}, a decode step takes {skipped['step_s']:.2f} s")
    for kind, option in entry["plans"].items():
        times = entry.get("seconds", {}).get(kind, {})
        if kind in NUMERIC:
            parts.append(f"{kind}={'never' if option == NEVER else option}")
        elif times:
            ms = ", ".join(f"{o} {s * 1e3:.1f} ms" for o, s in times.items())
            parts.append(f"{kind}={option} ({ms} per step)")
        else:
            parts.append(f"{kind}={option}")
    return "; ".join(parts)


def read_entries() -> dict:
    """What the plan cache holds, {key: entry} (empty if it is missing or unreadable)."""
    return entries.read_entries(cache_path())


def store_entry(key: str, entry: dict) -> None:
    """Add one machine's plans (``files/entries.py``: atomic; skipped if it cannot be written,
    and the plans are measured again next time)."""
    entries.store_entry(cache_path(), key, entry)
