"""Decode's one-row products on two CPU threads (MLX's CPU backend only).

A decode step multiplies one row by every weight matrix of the model. On
MLX's CPU backend those products use one thread each: the quantized kernel
is single-threaded, and OpenBLAS threads a one-row sgemm poorly. MLX runs
each stream on its own thread, so the products here are spread over two
worker streams (:func:`worker_streams`):

- a large matrix is cut into two blocks of output rows, one per stream, and
  the two results are concatenated (:class:`CPULinear`, :func:`quantized_product`,
  :func:`project` for the LM head);
- quantized sibling layers that read the same input (q/k/v, gate/up:
  :data:`SIBLINGS`) run whole, side by side, one stream each
  (:func:`plan_siblings`): no cut, no concatenation, or with the largest cut
  to balance the two streams (which of these pays is measured: ``plans``).
  Float siblings are left alone: OpenBLAS threads their products itself.
- a float gated MLP runs as two half MLPs, one per stream, over halves of
  its hidden units (:func:`mlp_in_halves`): gate and up by rows, down by
  columns, which it holds transposed (:class:`TransposedLinear`) so that each
  half is one contiguous block. The two streams meet once, in the sum of the
  halves, instead of once per projection.

Where the compiled kernels are loaded (``compiled``) and a layer's plan says ``kernel``, its
few-row product is one kernel call instead: the kernel threads itself, so no split.

On Metal none of this is used: one kernel uses the whole GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from . import compiled, ops

Part = tuple[int, int, int]  # (worker stream, first output row, end row) of one layer's product


@dataclasses.dataclass
class LayerPlan:
    """How one layer's few-row (decode) product runs: set at load by the backend, and switched by
    the measurement in ``plans``. Held as the layer's ``cpu_plan`` attribute (a plain object, so
    it stays out of the parameter tree)."""

    two_streams: bool = True  # spread over the worker streams; False: one call, as nn.Linear
    parts: tuple[Part, ...] | None = None  # explicit parts (siblings' plan), else two halves
    sibling_parts: tuple[Part, ...] | None = None  # the siblings' plan: each layer whole
    balanced_parts: tuple[Part, ...] | None = None  # ... with the largest cut to balance streams
    blocks: dict = dataclasses.field(default_factory=dict)  # row blocks, see row_block
    kernel: bool = False  # few rows through the compiled kernel (``compiled``): one call, no split


def plan_of(layer: nn.Module) -> LayerPlan:
    """The layer's plan, made on first use."""
    plan = getattr(layer, "cpu_plan", None)
    if plan is None:
        plan = LayerPlan()
        object.__setattr__(layer, "cpu_plan", plan)
    return plan


def two_streams(layer: nn.Module) -> bool:
    plan = getattr(layer, "cpu_plan", None)
    return plan is None or plan.two_streams


SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)  # layers of one module with one input

# Thread-local: MLX 0.32 ties a stream made by mx.new_stream to the thread that made it, and
# generation runs on whichever thread calls it (an app's worker, a server's engine thread).
_STREAMS = (mx.new_thread_local_stream(mx.cpu), mx.new_thread_local_stream(mx.cpu))


def worker_streams() -> tuple[mx.ThreadLocalStream, ...]:
    """Two CPU streams, each a stream of its own in every thread; MLX runs each on its own thread."""
    return _STREAMS


def halves(rows: int) -> tuple[Part, Part]:
    """The default plan: first half of the rows on stream 0, second half on stream 1."""
    return (0, 0, rows // 2), (1, rows // 2, rows)


def decode_parts(layer: nn.Module) -> tuple[Part, ...]:
    """The parts of ``layer``'s few-row product: its plan from :func:`plan_siblings`, else two halves."""
    return plan_of(layer).parts or halves(layer["weight"].shape[0])


def row_block(
    layer: nn.Module, start: int, stop: int, names: tuple[str, ...] = ("weight", "scales", "biases")
) -> tuple[mx.array, ...]:
    """Rows ``start:stop`` of those of a layer's parameters ``names`` it has: views (no copy),
    kept on the layer until its parameters are replaced (a slice built per call would be one
    more op in every decode step)."""
    params = tuple(layer[k] for k in names if layer.get(k) is not None)
    key = (start, stop, names, tuple(id(p) for p in params))
    blocks = plan_of(layer).blocks
    block = blocks.get(key)
    if block is None:
        block = tuple(p[start:stop] for p in params)
        # Evaluated now (views: no copy). Left lazy, a block would belong to this thread's
        # stream, and a request on another thread that found it here could not evaluate it.
        mx.eval(block)
        if len(blocks) >= 64:  # replaced parameters leave stale entries behind
            blocks.clear()
        blocks[key] = block
    return block


def _joined(outs: list[mx.array], layer: nn.Module) -> mx.array:
    y = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)
    return y + layer["bias"] if "bias" in layer else y


def quantized_product(x: mx.array, layer: nn.Module) -> mx.array:
    """``layer(x)`` for a quantized layer (or a quantized embedding used as the LM head), by parts.

    MLX's CPU quantized matmul is a scalar loop on one thread; by parts it runs
    on two (one 4-bit SmolLM2 layer cut in half: 1.55–1.9× as fast). With the ``kernel``
    plan, one call of the compiled kernel instead (``compiled``).
    """
    if compiled.runs(layer, x):
        return compiled.quantized_product(x, layer)
    streams = worker_streams()
    outs = [
        mx.quantized_matmul(
            x,
            *row_block(layer, start, stop),
            transpose=True,
            group_size=layer.group_size,
            bits=layer.bits,
            mode=getattr(layer, "mode", "affine"),
            stream=streams[s],
        )
        for s, start, stop in decode_parts(layer)
    ]
    return _joined(outs, layer)


class CPULinear(nn.Linear):
    """``nn.Linear`` whose few-row products (decode) run on the worker streams, by parts.

    For one row OpenBLAS threads a large sgemm poorly: SmolLM2's 1,536 × 576
    gate projection took 318 µs in one call and 126 µs as two half calls on two
    streams. Small matrices lose to the cut (576 × 576: 0.82×), so only layers
    of at least ``MIN_SIZE`` weights switch (see ``backends.cpu.apply``).
    """

    MIN_SIZE = 1 << 19
    MAX_ROWS = 16

    def __call__(self, x: mx.array) -> mx.array:
        if compiled.runs(self, x):
            return _kernel_linear(x, self)
        if x.size // x.shape[-1] > self.MAX_ROWS or not two_streams(self):
            return ops.padded_product(x, super().__call__, pad_rows_of(self))
        streams = worker_streams()
        return _joined(
            [
                mx.matmul(x, row_block(self, start, stop)[0].T, stream=streams[s])
                for s, start, stop in decode_parts(self)
            ],
            self,
        )


class TransposedLinear(nn.Module):
    """A float ``nn.Linear`` that holds its weight transposed: ``weight_t`` is (in, out).

    Rows ``a:b`` of ``weight_t`` are the weight's input columns ``a:b``, one
    contiguous block, which MLX's matmul reads in place (a column block of an
    (out, in) weight is strided: MLX would copy it on every call). For many
    rows the product is one BLAS call, as for ``nn.Linear``.

    The compiled kernel reads an (out, in) weight: the ``matvec=kernel`` plan has the layer
    hold ``weight`` instead (:meth:`hold_transposed`), and its MLP then runs whole.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = mx.contiguous(linear.weight.T)
        mx.eval(
            self.weight_t
        )  # now: left lazy, it would keep the (out, in) original alive until first use
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        if "weight" in self:  # held as (out, in) for the kernel
            if compiled.runs(self, x):
                return _kernel_linear(x, self)
            y = ops.padded_product(x, lambda z: z @ self.weight.T, pad_rows_of(self))
        else:
            y = ops.padded_product(x, lambda z: z @ self.weight_t, pad_rows_of(self))
        return y + self.bias if "bias" in self else y

    def hold_transposed(self, transposed: bool) -> None:
        """Hold the weight as ``weight_t`` (in, out: the MLP in halves) or as ``weight``
        (out, in: the compiled kernel); one copy, the other layout freed."""
        if transposed == ("weight_t" in self):
            return
        old = "weight" if transposed else "weight_t"
        new = mx.contiguous(self[old].T)
        mx.eval(new)
        del self[old]
        self["weight_t" if transposed else "weight"] = new
        plan_of(self).blocks.clear()


class PaddedLinear(nn.Linear):
    """A float ``nn.Linear`` too small for the two streams whose products of a few rows may
    run padded (``ops.padded_product``)."""

    def __call__(self, x: mx.array) -> mx.array:
        if compiled.runs(self, x):
            return _kernel_linear(x, self)
        return ops.padded_product(x, super().__call__, pad_rows_of(self))


def _kernel_linear(x: mx.array, layer: nn.Module) -> mx.array:
    """A float Linear's few-row product (``layer["weight"]`` (out, in)) as one kernel call."""
    y = compiled.matvec(x, layer["weight"])
    return y + layer["bias"] if "bias" in layer else y


def pad_rows_of(layer: nn.Module) -> int:
    """From how many rows the layer's float products run padded (the ``pad_rows`` plan)."""
    return getattr(layer, "cpu_pad_rows", ops.NO_PADDING)


GATED_MLP = (
    "gate_proj",
    "up_proj",
    "down_proj",
)  # a gated MLP's layers: down(act(gate(x)) * up(x))


def split_gated_mlp(mlp: nn.Module) -> bool:
    """Prepare a float gated MLP for :func:`mlp_in_halves` (its ``down_proj`` becomes a
    :class:`TransposedLinear`); False, and nothing changed, if it is not one or is small."""
    gate, up, down = (mlp.get(name) for name in GATED_MLP)
    if not all(type(layer) in (nn.Linear, CPULinear) for layer in (gate, up, down)):
        return False
    if gate.weight.size < CPULinear.MIN_SIZE:
        return False
    mlp.down_proj = TransposedLinear(down)
    return True


def runs_in_halves(x: mx.array, down: nn.Module) -> bool:
    """Whether a gated MLP with this ``down`` projection runs :func:`mlp_in_halves` for ``x``
    (not when its plan says one stream: ``plans``)."""
    return (
        isinstance(down, TransposedLinear)
        and "weight_t" in down
        and two_streams(down)
        and x.size // x.shape[-1] <= CPULinear.MAX_ROWS
    )


def mlp_in_halves(
    x: mx.array,
    gate: nn.Module,
    up: nn.Module,
    down: TransposedLinear,
    combine: Callable[[mx.array, mx.array], mx.array],
) -> mx.array:
    """``down(combine(gate(x), up(x)))`` for a few rows, as two half MLPs side by side.

    Hidden units are independent until ``down`` sums over them: the worker
    stream ``s`` computes half ``s`` of them (rows of ``gate`` and ``up``,
    rows of ``down.weight_t``) and its partial product with ``down``; the
    halves meet once, in their sum. SmolLM2-135M's f32 decode took 9–12% less
    time per step than with each projection cut in two and joined (5% at a
    2,048-token context), alternated in one process.
    """
    hidden = down.weight_t.shape[0]
    parts = []
    for stream, (start, stop) in zip(worker_streams(), ((0, hidden // 2), (hidden // 2, hidden))):
        with mx.stream(stream):
            g, u = (_rows_of(x, layer, start, stop) for layer in (gate, up))
            parts.append(combine(g, u) @ row_block(down, start, stop, ("weight_t",))[0])
    y = parts[0] + parts[1]
    return y + down.bias if "bias" in down else y


def _rows_of(x: mx.array, layer: nn.Module, start: int, stop: int) -> mx.array:
    """Outputs ``start:stop`` of a float Linear."""
    block = row_block(layer, start, stop, ("weight", "bias"))
    y = x @ block[0].T
    return y + block[1] if len(block) > 1 else y


def plan_siblings(layers: list[nn.Module], in_features: int) -> None:
    """Give sibling layers (one input, one width ``in_features``) their two decode plans.

    Whole (``sibling_parts``, the one in use): largest first, each layer goes
    whole to the stream with fewer weights so far. Balanced
    (``balanced_parts``): the same, but the largest layer on the heavier stream
    is cut so that both streams hold the same. A cut costs a second kernel call
    and a concatenation, so which pays is measured on the machine (``plans``:
    quantized=siblings or =balanced; docs/performance.md has the first machine's figures).
    """
    rows = [layer["weight"].shape[0] for layer in layers]
    load, stream_of = [0, 0], {}
    for i in sorted(range(len(layers)), key=lambda i: -rows[i]):
        s = stream_of[i] = load.index(min(load))
        load[s] += rows[i]
    heavy = load.index(max(load))
    excess = (load[heavy] - load[1 - heavy]) // 2  # rows to move so that both streams hold the same
    cut = max((i for i in stream_of if stream_of[i] == heavy), key=lambda i: rows[i])
    for i, layer in enumerate(layers):
        whole = ((stream_of[i], 0, rows[i]),)
        balanced = whole
        if i == cut and excess > 0:
            balanced = ((heavy, 0, rows[i] - excess), (1 - heavy, rows[i] - excess, rows[i]))
        plan = plan_of(layer)
        plan.parts = plan.sibling_parts = whole
        plan.balanced_parts = balanced


HEAD_CHUNK = 1024  # rows of the output projection per matmul (see project)


def project(x: mx.array, head: nn.Module) -> mx.array:
    """``x @ head.weight.T`` for a few rows of ``x`` against a tall float ``weight`` (the LM head:
    a Linear or the tied embedding; its bias is the caller's).

    OpenBLAS's sgemm packs its whole right-hand operand on every call, which
    for a one-row product costs more than the product: SmolLM2's 49,152 × 576
    head ran at ~8 GB/s in one call and ~13 GB/s in blocks of 1,024 rows that
    stay in cache while packed; alternating the blocks over two CPU streams
    (two threads) took it from 9.4 to 6.0 ms. With the ``kernel`` plan: one call of the
    compiled kernel (``compiled``).
    """
    if compiled.runs(head, x):
        return compiled.matvec(x, head["weight"])
    n = head["weight"].shape[0]
    if not two_streams(head) or n <= 2 * HEAD_CHUNK or x.size // x.shape[-1] > CPULinear.MAX_ROWS:
        return ops.padded_product(x, lambda z: z @ head["weight"].T, pad_rows_of(head))
    streams = worker_streams()
    blocks = [
        mx.matmul(
            x,
            row_block(head, i, i + HEAD_CHUNK, ("weight",))[0].T,
            stream=streams[(i // HEAD_CHUNK) % 2],
        )
        for i in range(0, n, HEAD_CHUNK)
    ]
    return mx.concatenate(blocks, axis=-1)
