"""The CPU backend: what a model loaded on MLX's CPU backend runs instead of Metal's kernels.

MLX's CPU backend has no fused kernels for RoPE, RMSNorm or attention (it runs
their reference graphs), its quantized matmul is a scalar loop on one thread,
and OpenBLAS threads one-row products poorly. :func:`apply` swaps this
package's layers into a loaded model once (``layers``), and chooses the decode
plans by timing them on this machine (``plans``). The modules:

- ``ops``: compiled replacements for ``mx.fast`` (RoPE tables, RMSNorm, the
  exponential, attention);
- ``quantized``: quantized layers that dequantize for prefill and run decode
  on two threads, and the stepwise prefill schedule;
- ``parallel``: one-row products over two worker streams;
- ``compiled``: products of up to 16 rows through the compiled kernels (``backends.kernels``,
  from ``csrc/``) where they are built and their plan wins here, a prompt's products in int16
  and its attention in one call;
- ``plans``: which of those pay here, measured (``timing`` for the decode steps, ``choices``
  for the thresholds' crossovers, over the ``kinds`` of plan) and cached;
- ``layers``: the mixins that put all of it into the model's own classes;
- ``blocks``: a decode step's whole block as four kernel calls.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable

import mlx.nn as nn

from . import blocks, layers, plans, quantized


def apply(model: nn.Module, *, log: Callable[[str], None] | None = None) -> int:
    """Swap the CPU layers into a loaded (evaluated) model and choose its decode plans here;
    returns how many modules changed."""
    n = layers.swap_layers(model)
    layers.bind_children(model)  # the blocks' child modules as plain attributes (not counted)
    n += blocks.swap_blocks(model)  # a decode step's block as the fused kernels (``decode`` plan)
    plans.choose(model, log=log)
    return n


def prefill_schedule(model: nn.Module) -> AbstractContextManager:
    """The context a prefill runs in: stepwise (``quantized.stepwise_prefill``), float models
    included, since the CPU backend's layers are in the model."""
    return quantized.stepwise_prefill(model, floats=True)
