"""The CPU backend's quantized layers: prefill through BLAS, decode on two threads.

MLX's CPU ``quantized_matmul`` is a scalar loop. For many rows (prefill) it is
far cheaper to dequantize a layer (:func:`dequantize`, one compiled kernel) and
call the BLAS matmul; for one row (decode) the quantized kernel reads 8× fewer
bytes, and runs on two CPU threads (``parallel``). A quantized model's prefill runs
stepwise (:func:`stepwise_prefill`) so that its dequantized matrices and
activations are alive one step at a time. On Metal the quantized kernels are
the fast path and none of this is used.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from . import compiled, parallel, tiles


def dequantize(
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """``mx.dequantize``, as one compiled elementwise kernel for affine 2- to 8-bit weights.

    On the CPU, ``mx.dequantize`` holds a second buffer the size of its float32
    result and took 2.6 ms for SmolLM2's 1,536 × 576 gate projection; this
    unpacks the 32-bit words by shifts and masks in one pass (1.1 ms, no extra
    buffer). 3, 5 and 6 bits straddle words: MLX packs every width as one little-endian
    bit stream, so 8 values are ``bits`` whole bytes, read as one 64-bit integer and
    shifted (MLX's own took 12 ms for a 5-bit 2,048 × 640 matrix, six times its 4-bit one:
    most of Gemma-3-270M's layers are 5-bit). Other modes use MLX's. Where the compiled kernels
    are loaded, a 2-D affine weight goes to theirs instead (``K.dequantize``: rows on the
    kernels' threads, every width as fast as 4-bit: 0.34-0.39 ms against 1.3-2.6 ms for this
    function's MLX form on a 2,048 x 640 matrix, 2-vCPU EPYC; csrc/README.md).
    """
    kernel = compiled.loaded()
    if (
        kernel is not None
        and hasattr(kernel, "dequantize")
        and mode == "affine"
        and biases is not None
        and w.ndim == 2
        and bits in compiled.QUANTIZED_BITS
        and group_size in compiled.GROUP_SIZES
    ):
        return kernel.dequantize(w, scales, biases, group_size, bits)
    if mode != "affine" or biases is None:
        return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    if 32 % bits:
        if bits not in (3, 5, 6) or group_size % 8:
            return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
        *lead, words = w.shape
        groups = scales.shape[-1]
        # (…, words) uint32 -> (…, groups, packs of 8 values, bits bytes)
        packed = mx.view(w, mx.uint8).reshape(*lead, groups, group_size // 8, bits)
        places = mx.arange(0, 8 * bits, 8, dtype=mx.uint64)
        shifts = mx.arange(0, 8 * bits, bits, dtype=mx.uint64)
        out = _unpack_bytes(
            packed,
            places,
            shifts,
            scales[..., None, None],
            biases[..., None, None],
            (1 << bits) - 1,
        )
        return out.reshape(*lead, groups * group_size)
    per_word = 32 // bits
    *lead, words = w.shape
    groups = scales.shape[-1]
    packed = w.reshape(*lead, groups, group_size // per_word, 1)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    out = _unpack(packed, shifts, scales[..., None, None], biases[..., None, None], (1 << bits) - 1)
    return out.reshape(*lead, words * per_word)


@mx.compile
def _unpack(
    packed: mx.array, shifts: mx.array, scales: mx.array, biases: mx.array, mask: int
) -> mx.array:
    # (…, groups, words per group, 1) >> (values per word,) -> every value of the group, then its affine map.
    q = (packed >> shifts) & mask
    return q.astype(scales.dtype) * scales + biases


@mx.compile
def _unpack_bytes(
    packed: mx.array,
    places: mx.array,
    shifts: mx.array,
    scales: mx.array,
    biases: mx.array,
    mask: int,
) -> mx.array:
    # (…, groups, packs, bits bytes): a pack's bytes as one little-endian integer of 8 * bits
    # bits, then (…, groups, packs, 8) values, then their affine map.
    stream = (packed.astype(mx.uint64) << places).sum(-1, keepdims=True)
    q = (stream >> shifts) & mask
    return q.astype(scales.dtype) * scales + biases


# Per thread (and task): one request's prefill must not make another's forward pass stepwise.
_stepwise: ContextVar[bool] = ContextVar("mlxinfer_stepwise_prefill", default=False)


@contextmanager
def stepwise_prefill(model: nn.Module, *, floats: bool = False) -> Iterator[None]:
    """Within the block, a quantized model's CPU prefill is evaluated one step at a time.

    ``prefill.prefill`` runs in it (``backends.prefill_schedule``). MLX allocates an op's result when it
    schedules the op, up to ten ops ahead of the CPU thread computing them, so
    a layer's dequantized matrices (3.5 MB each for SmolLM2's MLP in float32;
    180 MB for a 7B model's) and the buffers of its attention blocks would
    otherwise be alive several at once. Stepwise, :class:`CPUQuantizedLinear`
    evaluates each many-row product as it is built, attention each block of
    queries (``ops.attention``), and a gated MLP runs one slice of its
    hidden units at a time (:func:`sliced_mlp`). With ``floats`` a float model
    runs stepwise too, where only attention has blocks to evaluate (less memory
    at the same speed or better: docs/performance.md). Outside the block every layer stays lazy, so it can
    still be traced (``mx.compile``).
    """
    quantized = isinstance(model, nn.Module) and any(
        isinstance(m, CPUQuantizedLinear) for m in model.modules()
    )
    token = _stepwise.set(floats or quantized or _stepwise.get())
    try:
        yield
    finally:
        _stepwise.reset(token)


def stepwise() -> bool:
    """True inside :func:`stepwise_prefill` (for a quantized model, or any with ``floats``)."""
    return _stepwise.get()


INT16_NEVER = 1 << 30  # ``cpu_int16_rows`` where the int16 product is never used
MLP_SLICE = 512  # hidden units per slice of a stepwise gated MLP
MLP_SLICE_ROWS = (
    256  # fewest rows (tokens) for which slicing pays: at 128 it cost 19% of prefill speed
)


def slices_mlp(x: mx.array, gate: nn.Module, up: nn.Module, down: nn.Module) -> bool:
    """Whether :func:`sliced_mlp` applies: a stepwise prefill of enough rows through quantized
    layers, or through float ones (``down`` may be held transposed)."""
    rows = x.size // x.shape[-1]
    if not _stepwise.get() or rows < MLP_SLICE_ROWS:
        return False
    if all(isinstance(layer, CPUQuantizedLinear) for layer in (gate, up, down)):
        if all(rows >= m.cpu_int16_rows and compiled.int16_fits(m) for m in (gate, up, down)):
            return False  # the int16 products hold no dequantized weight: nothing to slice
        if all(tiles.takes_prompt(rows, m.bits) for m in (gate, up, down)):
            return False  # nor do the tiles (AVX2)
        return all(MLP_SLICE % max(layer.group_size, 32) == 0 for layer in (gate, up, down))
    return all(isinstance(layer, nn.Linear) for layer in (gate, up)) and isinstance(
        down, (nn.Linear, parallel.TransposedLinear)
    )


def sliced_mlp(
    x: mx.array,
    gate: nn.Module,
    up: nn.Module,
    down: nn.Module,
    combine: Callable[[mx.array, mx.array], mx.array],
) -> mx.array:
    """``down(combine(gate(x), up(x)))``, ``MLP_SLICE`` hidden units at a time, each step evaluated.

    The hidden units are independent until ``down`` sums over them, so slice j
    needs only rows j of ``gate`` and ``up`` and columns j of ``down``; the
    partial products add up to the whole. Every weight is still dequantized
    once, but the gate, up and activation buffers are a slice wide, and one
    slice of dequantized matrix is alive at a time: about half the transient
    memory at the same speed. Float layers take views of their weights instead
    (past ``MLP_SLICE_ROWS`` rows slicing would cost prefill speed; the figures:
    docs/performance.md).
    """
    hidden = gate["weight"].shape[0]
    out = None
    for start in range(0, hidden, MLP_SLICE):
        stop = min(start + MLP_SLICE, hidden)
        g = _evaluated(x @ _weight_block(gate, rows=slice(start, stop)).T, gate, start, stop)
        u = _evaluated(x @ _weight_block(up, rows=slice(start, stop)).T, up, start, stop)
        a = combine(g, u)
        mx.eval(a)  # each step evaluated, so that MLX cannot allocate the next ones ahead of it
        del g, u
        part = a @ _weight_block(down, columns=slice(start, stop)).T
        out = part if out is None else out + part
        mx.eval(out)
    return out + down["bias"] if "bias" in down else out


def _weight_block(
    layer: nn.Module, rows: slice = slice(None), columns: slice = slice(None)
) -> mx.array:
    """Rows (outputs) and columns (inputs) of a layer's weight, as floats: dequantized, or a view
    of a float weight (of ``weight_t`` for a transposed one, whose rows are the inputs)."""
    if "scales" in layer:
        return _dequantized(layer, rows, columns)
    if "weight_t" in layer:
        return layer["weight_t"][columns, rows].T
    return layer["weight"][rows, columns]


def _evaluated(y: mx.array, layer: nn.Module, start: int, stop: int) -> mx.array:
    y = y + layer["bias"][start:stop] if "bias" in layer else y
    mx.eval(y)
    return y


def _dequantized(
    layer: nn.Module,
    rows: slice = slice(None),
    columns: slice = slice(None),
    *,
    after: mx.array | None = None,
) -> mx.array:
    """A quantized layer's weight, or a block of it (column bounds on group bounds), dequantized.

    ``after``: not before that array is computed (MLX's breadth-first schedule would
    otherwise dequantize later layers' weights, which depend on nothing, ahead of time).
    """
    words = groups = columns
    if columns != slice(None):  # packed words and scale groups of those input columns
        words = slice(columns.start * layer.bits // 32, columns.stop * layer.bits // 32)
        groups = slice(columns.start // layer.group_size, columns.stop // layer.group_size)
    w, scales = layer["weight"][rows, words], layer["scales"][rows, groups]
    if after is not None:
        w, scales = mx.depends([w, scales], [after])
    biases = layer.get("biases")
    return dequantize(
        w,
        scales,
        None if biases is None else biases[rows, groups],
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
    )


HEAD_BLOCK = 8192  # vocabulary rows of a quantized tied head dequantized at a time


def head_rows(x: mx.array, head: nn.Module) -> mx.array:
    """A quantized embedding as the LM head over more rows than the kernels take (prompt
    positions, a pipeline's short chunks): its vocabulary dequantized a block at a time, each
    block after the one before (one block's floats alive at once), through the BLAS matmul.
    MLX's CPU ``quantized_matmul`` took 1.5 s for 54 rows of SmolLM2's 49,152 x 576 head."""
    outs: list[mx.array] = []
    for start in range(0, head["weight"].shape[0], HEAD_BLOCK):
        block = slice(start, start + HEAD_BLOCK)
        outs.append(x @ _dequantized(head, rows=block, after=outs[-1] if outs else x).T)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)


class CPUQuantizedLinear(nn.QuantizedLinear):
    """CPU backend only: many-row inputs (prefill) dequantize the weight and use BLAS.

    MLX's CPU ``quantized_matmul`` is a simple loop: at 512 rows it is ~10×
    slower than dequantizing the layer and calling the (OpenBLAS) matmul. One
    row (decode) stays on the quantized kernel, which reads 8× fewer bytes. On
    Metal the quantized kernels are the fast path and this class is not used.
    """

    # From this many rows the dequantized product is used; ``plans`` measures the crossover per
    # model on the machine and sets it on each layer (this is the default when it does not).
    MIN_ROWS = 32
    # ``product(x, layer)`` where the plan says ``kernel`` and the kernels are loaded: decided
    # when the plan is set (``compiled.bind``), so a decode step checks only the rows here.
    cpu_kernel = None
    # From this many rows the int16 product (``compiled.int16_product``, AVX-512 VNNI) is used
    # where it fits; ``plans`` measures it (``int16_rows``); never without a plan.
    cpu_int16_rows = INT16_NEVER

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows >= self.cpu_int16_rows and compiled.int16_fits(self):
            return self._int16_rows(x)
        if rows < self.MIN_ROWS:
            # The kernel takes every row below the crossover, not only ``compiled.MAX_ROWS``:
            # between the two MLX's quantized_matmul (a scalar loop, its time growing with the
            # rows) ran a 24-token prompt chunk of SmolLM2 in 2.2 s against 0.09 s for 16 rows.
            kernel = self.cpu_kernel
            if kernel is not None:
                return kernel(x, self)
            return self._few_rows(x)
        if tiles.takes_prompt(rows, self.bits):  # AVX2: up to tiles.AVX2_ROWS, the tiles
            y = self._tiled_rows(x)
            if y is not None:
                return y
        return self._many_rows(x)

    def _tiled_rows(self, x: mx.array) -> mx.array | None:
        """A prompt's rows through the layer's tiles (``tiles.takes_prompt``: on AVX2 they beat
        the dequantized weight and BLAS up to some hundred rows), or None where it has none."""
        if getattr(self, "mode", "affine") != "affine" or "biases" not in self:
            return None
        arrays = (self["weight"], self["scales"], self["biases"])
        y = tiles.product(x, self, *arrays, self.group_size, self.bits)
        if y is None:
            return None
        y = y + self["bias"] if "bias" in self else y
        if _stepwise.get():
            mx.eval(y)
        return y

    def _int16_rows(self, x: mx.array) -> mx.array:
        """Prefill through the int16 kernel: no dequantized weight, x rounded to int16."""
        y = compiled.int16_product(x, self)
        if _stepwise.get():
            mx.eval(y)
        return y

    def _many_rows(self, x: mx.array) -> mx.array:
        """Prefill: dequantize the weight (one compiled kernel) and use the BLAS matmul."""
        y = x @ _dequantized(self, after=x).T
        y = y + self["bias"] if "bias" in self else y
        if _stepwise.get():
            mx.eval(y)
        return y

    def _few_rows(self, x: mx.array) -> mx.array:
        """Decode: the quantized kernel, on two CPU threads by parts (``parallel``), or the
        compiled kernel in one call (the ``kernel`` plan: any rows below ``MIN_ROWS``, where the
        dequantized product takes over)."""
        if compiled.runs(self, x, max_rows=None):
            return compiled.quantized_product(x, self)
        plan = parallel.plan_of(self)
        if not plan.two_streams or (self["weight"].shape[0] < 2 * 64 and plan.parts is None):
            return super().__call__(x)  # one stream, or too small to cut with no siblings beside
        return parallel.quantized_product(x, self)
