"""The CPU backend's versions of the shared layers, swapped in at load by :func:`swap_layers`.

Each is a mixin over the model's own class that overrides the one step the
CPU runs differently (``normalize``, ``rotate``, ``attend``, the gated MLP's
``__call__`` and ``combine``, the LM head's product), with the same fields and
parameters; everything else is the model's. On Metal none of these exist: the
model's classes run as written, on ``mx.fast``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...cache.kv import Cache, Mask
from ...models import layers
from . import attention_kernels, compiled, fused, ops, parallel, quantized


class CPUNorm:
    """RMSNorm (either form) as one compiled kernel instead of ``mx.fast.rms_norm``'s graph."""

    cpu_decode_kernel = False  # set by the ``decode`` plan (``kinds``)
    cpu_rms_norm = None  # ... with the kernel's function (``compiled.decode_kernels``)

    def normalize(self, x: mx.array, weight: mx.array) -> mx.array:
        # The ``decode`` plan: one kernel call for a few rows. The kernel rounds the normalised
        # rows to x's dtype; mixed dtypes (a float mode's bfloat16 embedding rows before float32
        # weights) take ops, which promotes as mx.fast.rms_norm does.
        # Prefill's rows take the kernel wherever it is loaded (no plan: 128 x 640 in 152 us
        # against ops' 317 us, 512 x 576 408 against 999, 2-vCPU EPYC).
        if x.dtype == weight.dtype:
            if x.size // max(1, x.shape[-1]) <= compiled.MAX_ROWS:
                kernel = self.cpu_rms_norm
            else:
                kernel = getattr(compiled.loaded(), "rms_norm", None)
            if kernel is not None:
                return kernel(x, weight, self.eps)
        return ops.rms_norm(x, weight, self.eps)


class CPUOffsetNorm(CPUNorm):
    """Gemma's ``(1 + w)`` norm with ``1 + w`` formed once, when the backend is applied
    (:meth:`keep_one_plus`), not at every call (two primitives a norm, ~220 a Gemma-3-270M
    decode step). Kept beside the weight it was made from: a replaced weight takes the
    model's own per-call form. Made evaluated, so any thread's graph may read it (a lazy
    array made on one thread cannot be evaluated on another's stream: the batching engine's)."""

    def keep_one_plus(self) -> None:
        weight = self["weight"]
        one_plus = 1.0 + weight.astype(mx.float32)
        mx.eval(one_plus)
        object.__setattr__(self, "_cpu_one_plus", (weight, one_plus))

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        kept = self.__dict__.get("_cpu_one_plus")
        one_plus = kept[1] if kept is not None and kept[0] is weight else None
        if one_plus is None:
            one_plus = 1.0 + weight.astype(mx.float32)
        return self.normalize(x, one_plus).astype(x.dtype)


class CPURoPE:
    """RoPE from a cos/sin table shared by every layer of a forward pass (see ``ops``)."""

    def rotate(self, x: mx.array, offset: int | mx.array, base: float) -> mx.array:
        cos, sin = self.table(offset, x.shape[-2], base)
        return ops.apply_rope(x, cos, sin, dims=self.dims, traditional=self.traditional)

    def table(self, offset: int | mx.array, length: int, base: float) -> tuple[mx.array, mx.array]:
        """(cos, sin) for ``length`` positions after ``offset`` (an int, or a batch's (B,) offsets:
        ``ops.rope_rows_table``), shared by the layers of a forward pass."""
        key, inv_freq = self._table_source(base)
        if isinstance(offset, mx.array):  # a batch's rows, each at its own position
            return ops.rope_rows_table(inv_freq, key, offset, length, self.scale)
        return ops.rope_table(inv_freq, key, offset, length, self.scale)

    def _table_source(self, base: float) -> tuple[tuple, mx.array]:
        """(key, inv_freq): the frequencies, and a key that layers with the same ones share.
        Built once per base (dynamic NTK moves the base as the sequence grows)."""
        cached = self.__dict__.get("_cpu_table_source")
        if cached is None or cached[0] != base:
            if self._inv_freq is not None:
                freqs = np.asarray(self._inv_freq, np.float32)
            else:
                freqs = (base ** (-np.arange(0, self.dims, 2) / self.dims)).astype(np.float32)
            key = (self.dims, hash(freqs.tobytes()))
            cached = self.__dict__["_cpu_table_source"] = (base, key, mx.array(freqs))
            mx.eval(cached[2])  # evaluated: any thread may use it
        return cached[1], cached[2]


class CPUAttention:
    """Attention through ``ops.attention``: grouped heads without copies, the fast exponential,
    causal blocks that skip the masked triangle; a quantized cache is dequantized for prefill;
    under the ``decode`` plan, a decode step of plain RoPE attention over a ``KVCache`` as three
    compiled-kernel calls, and any decode attention over a batch's pool pages as one."""

    cpu_decode_kernel = False  # set by the ``decode`` plan (``kinds``)
    cpu_decode_fits = False  # ... with ``attention_kernels.attention_fits``

    exp = staticmethod(ops.exp)

    def __call__(self, x: mx.array, mask: Mask, cache: Cache | None, *args: Any) -> mx.array:
        if args:  # the family's own positions (RopeAttention's ``positions``): its own path
            return super().__call__(x, mask, cache, *args)
        if self.cpu_decode_kernel and self.cpu_decode_fits:  # the ``decode`` plan (``compiled``)
            y = attention_kernels.decode_attention(self, x, mask, cache)
            if y is None:  # the batching engine's step over its pool's pages
                y = attention_kernels.paged_decode_attention(self, x, mask, cache)
            if y is not None:
                return y
        return super().__call__(x, mask, cache)

    def attend_pages(
        self, q: mx.array, pages: Any, *, scale: float, sinks: mx.array | None = None
    ) -> mx.array:
        if self.cpu_decode_kernel and sinks is None and q.shape[2] == 1:  # the ``decode`` plan
            return attention_kernels.paged_attention(q, pages, scale)
        return super().attend_pages(q, pages, scale=scale, sinks=sinks)

    def attend_keys(
        self,
        q: mx.array,
        k: Any,
        v: Any,
        *,
        scale: float,
        mask: Mask,
        cache: Cache | None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if sinks is not None:  # attention sinks (gpt-oss): the model's own path, mx.fast's kernel
            return super().attend_keys(q, k, v, scale=scale, mask=mask, cache=cache, sinks=sinks)
        if cache is not None and cache.quantized:
            if self.cpu_decode_kernel:  # the ``decode`` plan: a decode token's, read packed
                y = attention_kernels.quantized_decode_attention(q, cache, scale, mask)
                if y is not None:
                    return y
            rows = getattr(self, "cpu_dequantized_attention_rows", ops.DEQUANTIZED_ATTENTION_ROWS)
            if q.shape[2] < rows:  # the crossover ``plans`` measured (dequantized_attention)
                return super().attend_keys(q, k, v, scale=scale, mask=mask, cache=cache)
            # MLX's CPU quantized matmul is a scalar loop: for a prefill chunk it is far
            # cheaper to dequantize this layer's keys and values once (a transient copy).
            group_size, bits = cache.group_size, cache.bits
            k, v = (quantized.dequantize(*t, group_size=group_size, bits=bits) for t in (k, v))
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        y = attention_kernels.prefill_attention(q, k, v, scale, mask)  # a prompt's, where it fits
        if y is not None:
            return y
        long_keys = getattr(self, "cpu_long_keys", ops.DECODE_LONG_KEYS)  # set by ``plans``
        small = getattr(self, "cpu_small", ops.SMALL)
        return ops.attention(
            q,
            k,
            v,
            scale=scale,
            mask=mask,
            evaluate_blocks=quantized.stepwise(),
            long_keys=long_keys,
            small=small,
        )


class CPUGatedMLP:
    """A gated MLP sliced through a stepwise quantized prefill, or run as two half MLPs on the
    worker streams in decode (float); SwiGLU through the fast exponential, or under the
    ``decode`` plan one compiled kernel for a few rows."""

    cpu_decode_kernel = False  # set by the ``decode`` plan (``kinds``)
    cpu_swiglu = None  # ... with the kernel's function (``compiled.decode_kernels``)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        if quantized.slices_mlp(x, gate, up, down):
            return quantized.sliced_mlp(x, gate, up, down, self.combine)
        if parallel.runs_in_halves(x, down):
            return parallel.mlp_in_halves(x, gate, up, down, self.combine)
        return super().__call__(x)

    def combine(self, gate: mx.array, up: mx.array) -> mx.array:
        few = gate.size // max(1, gate.shape[-1]) <= compiled.MAX_ROWS
        if not few or self.act is nn.gelu_approx:
            # Prefill's rows, and GELU's at any count: the kernel wherever it is loaded, no plan
            # (10-70x MLX's forms past 16 rows; a few rows of MLX's tanh took 2x the kernel).
            y = compiled.gated(gate, up, self.act)
            if y is not None:
                return y
        if self.act is nn.silu:
            kernel = self.cpu_swiglu  # the ``decode`` plan: one kernel call for a few rows
            if kernel is not None and few and gate.dtype == mx.float32 and up.dtype == mx.float32:
                return kernel(gate, up)
            return ops.swiglu(gate, up, small=getattr(self, "cpu_small", ops.SMALL))
        return super().combine(gate, up)


class CPUTiedHead:
    """A token embedding used as the LM head: float rows in blocks on the worker streams
    (``parallel.project``); a quantized one by parts; either as one compiled-kernel call where
    its plan says ``kernel`` (``compiled``); a quantized one's many rows (a prompt's positions,
    ``perplexity``) through the int16 kernel from the ``int16_rows`` plan's rows, and its few
    rows (decode) up to the ``int16_head`` plan's."""

    cpu_int16_rows = quantized.INT16_NEVER  # set by the ``int16_rows`` plan (``kinds``)
    cpu_int16_head_rows = 0  # up to this many rows, the int16 kernel (the ``int16_head`` plan)

    def as_linear(self, x: mx.array) -> mx.array:
        if "scales" not in self:
            return parallel.project(x, self)
        rows = x.size // x.shape[-1]
        if rows <= self.cpu_int16_head_rows and compiled.int16_fits(self):  # decode's rows
            return compiled.int16_product(x, self)
        if rows >= self.cpu_int16_rows and compiled.int16_fits(self):  # a prompt's positions
            return compiled.int16_product(x, self)
        if rows <= parallel.CPULinear.MAX_ROWS and self["weight"].shape[0] >= 128:
            return parallel.quantized_product(x, self)
        if rows > parallel.CPULinear.MAX_ROWS:
            return quantized.head_rows(x, self)
        return super().as_linear(x)


class CPUHead:
    """A separate float LM head: its rows in blocks on the worker streams (``parallel.project``),
    or one compiled-kernel call (the ``head=kernel`` plan)."""

    def __call__(self, x: mx.array) -> mx.array:
        logits = parallel.project(x, self)
        return logits + self["bias"] if "bias" in self else logits


class CPUBoundChildren:
    """A module of a block whose child modules are also its plain attributes (its instance
    ``__dict__``), so that ``self.mlp`` in the model's forward is an ordinary attribute read,
    not ``nn.Module.__getattr__``'s dict lookup after a failed one (~0.5 µs; ~15 a block in
    every decode step, a sixth of a small model's graph building). Kept in step with the
    module's dict: a child set or deleted through either (``module.x = ...``, ``module["x"] =
    ...``, ``del``, ``update_modules``) is set or dropped in both."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)  # type: ignore[misc]
        if isinstance(value, nn.Module):
            self.__dict__[key] = value
        else:
            self.__dict__.pop(key, None)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)  # type: ignore[misc]
        self.__dict__.pop(key, None)


def bind_children(model: nn.Module) -> int:
    """Give the modules inside the model's blocks (those under a list: ``layers.3``,
    ``layers.3.self_attn``) :class:`CPUBoundChildren`, their child modules bound as
    attributes; the model and its inner network keep their own classes (their names key
    prompt-cache fingerprints). Returns how many modules changed."""
    n = 0
    for name, module in model.named_modules():
        children = {k: v for k, v in module.items() if isinstance(v, nn.Module)}
        if not children or not any(part.isdigit() for part in name.split(".")):
            continue
        with_mixin(module, CPUBoundChildren)
        module.__dict__.update(children)
        n += 1
    return n


MIXINS = (
    (layers.OffsetRMSNorm, CPUOffsetNorm),  # before RMSNorm's: a subclass of its mixin
    (layers.RMSNorm, CPUNorm),
    (layers.RoPE, CPURoPE),
    (layers.Attention, CPUAttention),
    (layers.GatedMLP, CPUGatedMLP),
)
_CLASSES: dict[tuple[type, type], type] = {}


def with_mixin(module: nn.Module, mixin: type) -> None:
    """Give ``module`` the class ``mixin + its class``: same fields and parameters, the
    mixin's methods first. Made once per pair of classes."""
    cls = type(module)
    if issubclass(cls, mixin):
        return
    combined = _CLASSES.get((cls, mixin))
    if combined is None:
        combined = _CLASSES[(cls, mixin)] = type(
            f"{mixin.__name__}[{cls.__name__}]", (mixin, cls), {"__module__": __name__}
        )
    module.__class__ = combined


@contextmanager
def math_layers(model: nn.Module) -> Iterator[None]:
    """The model's norms, RoPE, attention and gated MLPs as :data:`MIXINS`' CPU versions (a
    prompt's attention as one kernel call, SwiGLU and GELU through the fast exponential, the
    norm's kernel) for what runs inside, their classes restored after. Only the math: no weight
    changes layout (no stacked siblings, transposed halves or Linear swaps), so a pass that swaps
    a layer's ``weight`` (a quantization plan's probes) sees each swap. Gemma's ``1 + w`` is
    formed per call (no :meth:`CPUOffsetNorm.keep_one_plus`)."""
    changed = []
    for _, module in model.named_modules():
        cls = type(module)
        for base, mixin in MIXINS:
            if isinstance(module, base):
                with_mixin(module, mixin)
        if type(module) is not cls:
            changed.append((module, cls))
    try:
        yield
    finally:
        for module, cls in changed:
            module.__class__ = cls
            for key in [k for k in module.__dict__ if k.startswith("_cpu_")]:
                del module.__dict__[key]


def swap_layers(model: nn.Module) -> int:
    """Swap the CPU versions into ``model``: the shared layers, the LM head, quantized Linears
    (:class:`quantized.CPUQuantizedLinear`) and large float ones (:class:`parallel.CPULinear`);
    hold large float gated MLPs' down projections transposed (``parallel.split_gated_mlp``),
    and plan how quantized siblings share the two threads (``parallel.plan_siblings``).

    Float siblings (q/k/v, gate/up) get one stacked weight, theirs becoming views of it
    (``fused``). Same outputs (up to float rounding) and parameters, except that a split MLP's
    down projection holds its weight as ``weight_t`` (in, out); returns how many modules changed.
    Only the loaded model changes: conversion writes the checkpoint's own layout.
    Float siblings are not planned: OpenBLAS threads their products itself, and SmolLM2's
    float32 q/k/v side by side on the two streams decoded 5% slower than one after the other.
    """
    n = 0
    head = getattr(model, "head", None)
    if isinstance(head, (nn.Embedding, nn.QuantizedEmbedding)):
        with_mixin(head, CPUTiedHead)
        n += 1
    elif type(head) is nn.Linear:  # a quantized head is a CPUQuantizedLinear below
        with_mixin(head, CPUHead)
        n += 1
    for _, module in model.named_modules():
        n += parallel.split_gated_mlp(module)
    for _, module in model.named_modules():
        for base, mixin in MIXINS:
            if isinstance(module, base):
                with_mixin(module, mixin)
                n += 1
        if isinstance(module, CPUOffsetNorm):
            module.keep_one_plus()
        if type(module) is nn.QuantizedLinear:
            module.__class__ = quantized.CPUQuantizedLinear  # a subclass: only __call__ differs
            n += 1
        elif type(module) is nn.Linear and module.weight.size >= parallel.CPULinear.MIN_SIZE:
            module.__class__ = parallel.CPULinear  # a subclass: only __call__ differs
            n += 1
        elif type(module) is nn.Linear and module is not head:
            module.__class__ = parallel.PaddedLinear  # a subclass: only __call__ differs
            n += 1
    for _, module in model.named_modules():
        n += fused.fuse_siblings(module, with_mixin)
        n += fused.fuse_quantized_siblings(module, with_mixin, quantized.CPUQuantizedLinear)
    for _, module in model.named_modules():
        for names in parallel.SIBLINGS:
            siblings = [module.get(name) for name in names]
            if all(isinstance(layer, quantized.CPUQuantizedLinear) for layer in siblings):
                widths = {layer["scales"].shape[-1] * layer.group_size for layer in siblings}
                if len(widths) == 1:
                    parallel.plan_siblings(siblings, widths.pop())
    return n
