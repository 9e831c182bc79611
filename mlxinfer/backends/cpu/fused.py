"""Float sibling projections (q/k/v, gate/up) as one product: one BLAS call where there were two or three.

Siblings read the same input, so their weights stacked by rows give every
output in one matrix product, which each sibling then takes its columns of.
The model still calls each projection in turn (``q_proj(x)``, ``k_proj(x)``,
…): the first call computes the stacked product and keeps it for the
others, which find it by the identity of ``x``. Each sibling's weight
becomes a view of the stacked one, so memory does not grow.

Whether it pays is measured (``plans``: kind ``fuse``); with it off each
sibling runs its own product (or its own plan: ``parallel.CPULinear``). With the
``matvec=kernel`` plan the stacked product of a few rows is one call of the compiled kernel.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import compiled, ops

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
            self.last = (x, y)
        if index == len(self.bounds) - 1:
            self.last = (None, None)  # the last sibling: drop the references
        a, b = self.bounds[index]
        return y[..., a:b]


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
        group = FusedGroup(layers)
        for index, layer in enumerate(layers):
            object.__setattr__(layer, "cpu_fused", (group, index))
            with_mixin(layer, CPUFusedSibling)
        n += 1
    return n
