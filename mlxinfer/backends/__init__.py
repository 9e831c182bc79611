"""Backends: what changes in a loaded model for the hardware that runs it.

The model code (``mlxinfer/models``) reads as it runs on Metal: ``mlx.nn`` and
``mx.fast``. On Metal (and MLX's other GPU backends) that is the whole story.
On MLX's CPU backend, :func:`apply` hands the model to ``backends.cpu``, which
swaps its own layers in once, at load. ``MLXINFER_CPU_OPS=0`` keeps the plain
MLX path on the CPU too (to compare the two; the parity tests run both).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

ENV = "MLXINFER_CPU_OPS"  # "0": no CPU backend, the plain MLX path


def name() -> str:
    """The backend a model loaded now gets: "cpu" on MLX's CPU backend, else "mlx"."""
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    return "cpu" if on_cpu and os.environ.get(ENV, "") != "0" else "mlx"


def apply(model: nn.Module, *, log: Callable[[str], None] | None = None) -> str:
    """Prepare a loaded, evaluated model for this machine's backend; returns its name, which
    the model keeps as ``model.backend``."""
    backend = name()
    if backend == "cpu":
        from . import cpu

        cpu.apply(model, log=log)
    object.__setattr__(model, "backend", backend)
    return backend


def prefill_schedule(model: nn.Module) -> AbstractContextManager:
    """The context the model's prefill runs in, as its backend wants it (a model across ranks:
    its own, ``distributed.pipeline.RankModel.prefilling``)."""
    if hasattr(model, "prefilling"):
        return model.prefilling()
    if getattr(model, "backend", None) == "cpu":
        from . import cpu

        return cpu.prefill_schedule(model)
    return nullcontext()


def planning_layers(model: nn.Module) -> AbstractContextManager:
    """The context a quantization plan's passes over a float model run in (``quant.mixed``):
    on the CPU backend its norms, RoPE, attention and gated MLPs (their prompt kernels: a
    256-token block of SmolLM2 in 11 ms against MLX's ops' 26), no weight laid out anew, so
    each probe's swapped weight is what runs; elsewhere nothing changes."""
    if name() != "cpu":
        return nullcontext()
    from .cpu import layers

    return layers.math_layers(model)


def log_probs_argmax(logits: mx.array) -> tuple[mx.array, mx.array]:
    """``log_probs(logits)`` and ``mx.argmax(logits, axis=-1)``: on the CPU backend one kernel
    call over the rows (``cpu.compiled.log_softmax_argmax``), else MLX's ops."""
    if name() == "cpu":
        from .cpu import compiled

        out = compiled.log_softmax_argmax(logits)
        if out is not None:
            return out
    return log_probs(logits), mx.argmax(logits, axis=-1)


def log_probs(logits: mx.array) -> mx.array:
    """``logits - logsumexp(logits)`` over the last axis: on the CPU backend one compiled
    kernel where the kernels are built (``cpu.compiled.log_softmax``), else MLX's ops."""
    if name() == "cpu":
        from .cpu import compiled

        out = compiled.log_softmax(logits)
        if out is not None:
            return out
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sample(
    logits: mx.array,
    key: mx.array,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> mx.array | None:
    """A token per row of (B, V) logits, drawn from the distribution
    ``generation.sampling.filtered_logprobs`` gives them, as one compiled kernel call on the CPU
    backend (``cpu.compiled.sample``: ~1-2 ms for a 262,144-token vocabulary where MLX's sort
    and Gumbel draw took 8-45 ms); None elsewhere (MLX's own ops then)."""
    if name() == "cpu":
        from .cpu import compiled

        return compiled.sample(logits, key, temperature, top_k, top_p, min_p)
    return None


def describe(model: nn.Module) -> dict:
    """The model's backend and, on the CPU, the decode plans it runs with (for reports)."""
    backend = getattr(model, "backend", None)
    if backend == "cpu":
        from .cpu import plans

        return {"backend": backend, "cpu_plans": plans.current(model)}
    return {"backend": backend}
