"""Sibling projections (q/k/v, gate/up) as one product: one BLAS or kernel call where there were two or three.

Siblings read the same input, so their weights stacked by rows give every
output in one matrix product, which each sibling then takes its columns of.
The model still calls each projection in turn (``q_proj(x)``, ``k_proj(x)``,
…): the first call computes the stacked product and keeps it for the
others, which find it by the identity of ``x``. Each sibling's weight
becomes a view of the stacked one, so memory does not grow.

Whether it pays is measured (``plans``: kind ``fuse``); with it off each
sibling runs its own product (or its own plan: ``parallel.CPULinear``). With the
``matvec=kernel`` plan the stacked product of a few rows is one call of the compiled kernel.

Quantized siblings of one format (bits, group size, mode; :class:`QuantizedGroup`) are stacked
the same way, codes, scales and biases by rows, and their few-row products (decode, below the
dequantized product's crossover) are one call of the compiled quantized kernel where their plan
says ``kernel``: SmolLM2-135M's decode step makes 90 kernel calls fewer (five products a block
become two), and the stacked call spreads over the kernels' threads where a 192-row k or v
product alone did not pay to split. Many rows (prefill) still go sibling by sibling.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import compiled, ops, quantized, tiles

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedGroup:
    """The stacked weight (and bias) of siblings, and the last input's product."""

    def __init__(self, layers: list[nn.Linear]):
        self.bounds, start = [], 0
        for layer in layers:
            rows = layer.weight.shape[0]
            self.bounds.append((start, start + rows))
            start += rows
        self.weight = mx.concatenate([layer.weight for layer in layers])
        with_bias = "bias" in layers[0]
        self.bias = mx.concatenate([layer.bias for layer in layers]) if with_bias else None
        mx.eval(self.weight if self.bias is None else [self.weight, self.bias])
        for layer, (a, b) in zip(layers, self.bounds):
            layer.weight = self.weight[a:b]  # views of the stacked weight: no second copy
            if with_bias:
                layer.bias = self.bias[a:b]
            mx.eval(layer.parameters())
        self.on = True
        self.last: tuple = (None, None)  # (input, product) of the sibling call in progress

    def output(
        self, x: mx.array, index: int, pad_rows: int = ops.NO_PADDING, kernel: bool = False
    ) -> mx.array:
        seen, y = self.last  # one read: another thread may replace it
        if seen is not x:
            if kernel:  # the compiled kernel (``compiled``): its caller checked the rows
                y = compiled.matvec(x, self.weight)
            else:
                y = ops.padded_product(x, lambda z: z @ self.weight.T, pad_rows)
            if self.bias is not None:
                y = y + self.bias
            y = mx.split(y, [b for _, b in self.bounds[:-1]], axis=-1)  # one primitive for all
            self.last = (x, y)
        if index == len(self.bounds) - 1:
            self.last = (None, None)  # the last sibling: drop the references
        return y[index]


class CPUFusedSibling:
    """A float Linear that is one of a :class:`FusedGroup`: its columns of the stacked product."""

    def __call__(self, x: mx.array) -> mx.array:
        group, index = self.cpu_fused
        if group.on:
            pad_rows = getattr(self, "cpu_pad_rows", ops.NO_PADDING)
            return group.output(x, index, pad_rows, compiled.runs(self, x))
        return super().__call__(x)


def fuse_siblings(module: nn.Module, with_mixin) -> int:
    """Stack the float siblings of ``module`` that share input and bias layout; how many groups."""
    n = 0
    for names in SIBLINGS:
        layers = [module.get(name) for name in names]
        if not all(isinstance(layer, nn.Linear) and "weight" in layer for layer in layers):
            continue
        if (
            len({layer.weight.shape[1] for layer in layers}) != 1
            or len({("bias" in layer, layer.weight.dtype) for layer in layers}) != 1
        ):
            continue
        _attach(FusedGroup(layers), layers, CPUFusedSibling, with_mixin)
        n += 1
    return n


def _attach(group, layers: list[nn.Module], mixin: type, with_mixin) -> None:
    """Each sibling learns its group and index (``cpu_fused``) and takes the group's mixin."""
    for index, layer in enumerate(layers):
        object.__setattr__(layer, "cpu_fused", (group, index))
        with_mixin(layer, mixin)


class QuantizedGroup:
    """The stacked codes, scales and biases (and bias) of quantized siblings of one format, and
    the last input's product (as :class:`FusedGroup`)."""

    KEYS = ("weight", "scales", "biases", "bias")

    def __init__(self, layers: list[nn.Module]):
        self.bounds, start = [], 0
        for layer in layers:
            rows = layer["weight"].shape[0]
            self.bounds.append((start, start + rows))
            start += rows
        first = layers[0]
        self.group_size, self.bits = first.group_size, first.bits
        self.mode = getattr(first, "mode", "affine")
        self.arrays = {
            key: mx.concatenate([layer[key] for layer in layers])
            for key in self.KEYS
            if key in first
        }
        mx.eval(list(self.arrays.values()))
        for layer, (a, b) in zip(layers, self.bounds):
            for key, stacked in self.arrays.items():
                layer[key] = stacked[a:b]  # views of the stacked arrays: no second copy
            mx.eval(layer.parameters())
        self.on = True
        self.last: tuple = (None, None)

    def int16_fits(self) -> bool:
        """Whether the stacked product may take the int16 kernel (as ``compiled.int16_fits``)."""
        k = compiled.loaded()
        return (
            self.mode == "affine"
            and "biases" in self.arrays
            and self.arrays["weight"].shape[0] % 32 == 0
            and k is not None
            and hasattr(k, "quantized_matmul_i16")
            and k.vnni_available()
        )

    def tiled_prompt(self, rows: int) -> bool:
        """Whether a prompt's ``rows`` take the stacked product's tiles (``tiles.takes_prompt``:
        AVX2), which it has (made here where they fit the machine)."""
        if self.mode != "affine" or "biases" not in self.arrays:
            return False
        if not tiles.takes_prompt(rows, self.bits):
            return False
        a = self.arrays
        return (
            tiles.of(self, a["weight"], a["scales"], a["biases"], self.group_size, self.bits)
            is not None
        )

    def output(self, x: mx.array, index: int, *, int16: bool = False) -> mx.array:
        """Sibling ``index``'s columns of the stacked product with ``x``: the few-row kernel's,
        or with ``int16`` the int16 kernel's (a prompt's rows, evaluated in a stepwise prefill)."""
        seen, y = self.last  # one read: another thread may replace it
        if seen is not x:
            a = self.arrays
            options = {} if self.mode == "affine" else {"mode": self.mode}
            k = compiled.loaded()
            arrays = (a["weight"], a["scales"], a.get("biases"))
            y = None
            if tiles.on() and self.mode == "affine":  # int16 or not: the tiles' product
                y = tiles.product(x, self, *arrays, self.group_size, self.bits)
            if y is None and int16:
                y = k.quantized_matmul_i16(x, *arrays, self.group_size, self.bits)
            elif y is None:
                y = k.quantized_matvec(x, *arrays, self.group_size, self.bits, **options)
            if "bias" in a:
                y = y + a["bias"]
            # one split (one primitive, every sibling's columns) rather than a slice each
            y = mx.split(y, [b for _, b in self.bounds[:-1]], axis=-1)
            if int16 and quantized.stepwise():
                mx.eval(y)
            self.last = (x, y)
        if index == len(self.bounds) - 1:
            self.last = (None, None)
        return y[index]


class CPUFusedQuantizedSibling:
    """A quantized Linear of a :class:`QuantizedGroup`: below the dequantized product's
    crossover (and the int16 product's), where its plan gives it the kernel, its rows of the
    stacked product."""

    def __call__(self, x: mx.array) -> mx.array:
        group, index = self.cpu_fused
        rows = x.size // x.shape[-1]
        if group.on and rows >= self.cpu_int16_rows and group.int16_fits():
            return group.output(x, index, int16=True)  # a prompt's rows: one int16 product
        if group.on and self.cpu_kernel is not None and rows < self.MIN_ROWS:
            return group.output(x, index)
        if group.on and rows >= self.MIN_ROWS and group.tiled_prompt(rows):
            return group.output(x, index)  # AVX2: a prompt's rows on the group's tiles
        return super().__call__(x)


def fuse_quantized_siblings(module: nn.Module, with_mixin, kind: type) -> int:
    """Stack the quantized siblings (``kind``: the backend's quantized Linear) of ``module`` that
    share one format, input width and bias layout; how many groups."""
    n = 0
    for names in SIBLINGS:
        layers = [module.get(name) for name in names]
        if not all(type(layer) is kind for layer in layers):
            continue
        formats = {
            (
                layer.group_size,
                layer.bits,
                getattr(layer, "mode", "affine"),
                layer["scales"].shape[-1] * layer.group_size,
                layer["scales"].dtype,
                tuple(key in layer for key in QuantizedGroup.KEYS),
            )
            for layer in layers
        }
        if len(formats) != 1:
            continue
        _attach(QuantizedGroup(layers), layers, CPUFusedQuantizedSibling, with_mixin)
        n += 1
    return n
