"""Planning a model larger than memory: one block's weights resident at a time (issue 48, item 5).

The model's parameters are lazy loads: ``mx.load`` of a safetensors file reads a tensor when it
is first evaluated, and the array keeps its data for as long as the module holds it. Each pass
below runs the model's own forward with its blocks' classes swapped (``__call__`` is looked
up on the class, as ``calibrate._recording`` does), so a block's call is evaluated at once and
then its arrays are replaced by fresh lazy loads (:class:`Resident`): a pass holds one block's
weights, the embedding and the head, and the activations. The passes:

* :func:`calibrate`: the calibration sequences in one batch per length, so every sequence
  goes through block ``i`` before block ``i + 1``; each block's recorded inputs are summed
  when the block is evaluated. The logits are never evaluated (only the head's input is
  recorded), so a 262k-token vocabulary costs nothing here.
* :class:`StreamProbe`: the probe tokens' reference pass carries, beside the reference hidden
  state, one hidden state per tensor already perturbed (a "variant"): at block ``j`` every
  variant goes through the block as it is, and each tensor of block ``j`` quantized at its
  probe setting starts a new variant from the reference input. The embedding's variants start
  from the model's own input computation with the embedding quantized; a tied embedding stays
  quantized in the head too. At the end each variant's final state goes through the model's
  own final norm and head, one variant at a time (the blocks replay it), and its KL from the
  reference is taken: the numbers of ``calibrate.Probe.kl_with``, the same block calls on the
  same inputs. :meth:`StreamProbe.measure_plan` is one more pass with every planned tensor
  quantized.

A model whose blocks do not chain (a block's input is not the previous block's output), or
with quantizable tensors outside the blocks other than the embedding and the head, raises
:class:`Unsupported` from the probe; the caller then measures with the in-memory ``Probe``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .. import backends
from .calibrate import BlockCall, Statistics, _Recorder, _recording, hooked_blocks, kl_rows
from .covariances import CovarianceStore
from .plan import Setting, Tensor, fake_quantized, measure_errors, probe_settings, set_alpha

Progress = Callable[[str, int, int], None]


class Unsupported(Exception):
    """The streaming probe cannot follow this model's forward pass (see the module docstring)."""


class Resident:
    """A model whose parameters are lazy loads, and how to put fresh ones back.

    ``fresh()`` returns a new dict of lazy arrays by parameter path (the checkpoint read again
    with ``mx.load``, sanitized and cast as at load; nothing evaluated); :meth:`release` puts
    them in place of a module's arrays, dropping the data its evaluated ones held.
    """

    def __init__(self, model: nn.Module, fresh: Callable[[], dict[str, mx.array]]):
        self.model, self.fresh = model, fresh
        self.paths = {id(m): p for p, m in model.named_modules()}

    def release(self, modules: Sequence[nn.Module] | None = None) -> None:
        """Fresh lazy loads for ``modules``' parameters (None: the whole model's)."""
        new = self.fresh()
        for m in [self.model] if modules is None else modules:
            prefix = self.paths[id(m)]
            items = [(k, new[f"{prefix}.{k}" if prefix else k]) for k, _ in _arrays(m)]
            m.update(tree_unflatten(items))


def _arrays(m: nn.Module) -> list[tuple[str, mx.array]]:
    return tree_flatten(m.parameters())


def _layers(model: nn.Module) -> list[nn.Module]:
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, list) or not blocks:
        raise Unsupported("no list of blocks")
    return blocks


@contextmanager
def _blocks(model: nn.Module, call: BlockCall) -> Iterator[None]:
    """The model's blocks hooked (``calibrate.hooked_blocks``)."""
    with hooked_blocks(_layers(model), call):
        yield


def calibrate(
    model: nn.Module,
    sequences: Sequence[Sequence[int]],
    resident: Resident,
    *,
    covariance: bool = False,
    progress: Progress | None = None,
) -> Statistics:
    """``calibrate.calibrate`` block by block: the same statistics (summed in another order).
    With ``covariance``, each block's sums of ``x x^T`` go to disk once it is evaluated
    (``covariances.CovarianceStore``, the statistics' ``covariances``): one block's in memory."""
    recorder = _Recorder(covariance, CovarianceStore() if covariance else None)
    batches: dict[int, list[Sequence[int]]] = {}  # one batch per length, in order
    for s in sequences:
        batches.setdefault(len(s), []).append(s)
    n_blocks = len(_layers(model))
    total, done = n_blocks * len(batches), 0

    def call(i, block, run, args, kwargs):
        nonlocal done
        out = run(*args, **kwargs)
        recorder.evaluate(out)  # the block's output and what it recorded, in one pass
        recorder.spill()
        resident.release([block])
        done += 1
        if progress is not None:
            progress("calibration", done, total)
        return out

    try:
        with _recording(model, recorder), _blocks(model, call):
            for batch in batches.values():
                model(mx.array(batch))  # (B, L, V) never evaluated: the head's input is recorded
                recorder.evaluate()
                recorder.spill()
                resident.release()
    except BaseException:
        if recorder.store is not None:
            recorder.store.close()
        raise
    finally:
        resident.release()
    return recorder.statistics()


class _Variant:
    """The probe tokens' hidden state with one tensor quantized at one setting."""

    def __init__(self, tensor: Tensor, setting: Setting, h: mx.array):
        self.tensor, self.setting, self.h = tensor, setting, h


# Logits computed at a time at the end of a probe (positions x vocabulary): Gemma 3's 262,144-
# token vocabulary makes one (256, V) float32 array 268 MB, and the KL takes a few of them.
LOGIT_ELEMENTS = 1 << 24


class StreamProbe:
    """``calibrate.Probe`` for one sequence, measured in streaming passes (module docstring)."""

    def __init__(
        self, model: nn.Module, resident: Resident, tokens: Sequence[int], vocab: int
    ) -> None:
        self.model, self.resident, self.vocab = model, resident, vocab
        self.x = mx.array(tokens)[None]  # (1, L)
        blocks = _layers(model)
        self.n_blocks = len(blocks)
        self.block_of = {id(m): i for i, b in enumerate(blocks) for _, m in b.named_modules()}
        self.embedding = getattr(model, "embedding", None)
        self.head = getattr(model, "head", None)
        self.reference: list[mx.array] | None = None  # (rows, V) float32 log-probs per chunk
        self.probs: list[mx.array] = []  # their exp, made once

    def place(self, t: Tensor) -> int:
        """The block ``t`` is in; -1: the input embedding (tied or not); n_blocks: the head."""
        if id(t.module) in self.block_of:
            return self.block_of[id(t.module)]
        if t.module is self.embedding:
            return -1
        if t.module is self.head:
            return self.n_blocks
        raise Unsupported(f"{t.path} is outside the blocks")

    def _drive(self, call: BlockCall) -> mx.array:
        """The model's forward on the probe tokens with each block's call made by ``call``;
        returns the last block's output (the logits are built and never evaluated)."""
        outs: list[Any] = []

        def each(j, block, run, args, kwargs):
            if j > 0 and args[0] is not outs[-1]:
                raise Unsupported("a block's input is not the previous block's output")
            outs[:] = [call(j, block, run, args, kwargs)]
            return outs[0]

        with _blocks(self.model, each):
            self.model(self.x)
        return outs[0]

    def _logps(self, h: mx.array) -> Iterator[mx.array]:
        """Log-probs (rows, V) from ``h`` (1, L, H), the last block's output, a chunk of
        positions at a time: the last block replays those rows of ``h`` (the others their
        input, never evaluated), so only the model's own final norm and head run."""
        rows = max(1, LOGIT_ELEMENTS // max(self.vocab, 1))
        for i in range(0, h.shape[1], rows):
            part = h[:, i : i + rows]

            def call(j, block, run, args, kwargs, part=part):
                return part if j == self.n_blocks - 1 else args[0]

            with _blocks(self.model, call):
                logits = self.model(self.x)[0, :, : self.vocab].astype(mx.float32)  # (rows, V)
            yield backends.log_probs(logits)  # the CPU's kernel: MLX's exp does not vectorise

    def _kl(self, h: mx.array) -> float:
        """Mean KL per token of the model's output from ``h`` from the reference's."""
        assert self.reference is not None
        total, n = 0.0, 0
        for ref, probs, logp in zip(self.reference, self.probs, self._logps(h)):
            kld = kl_rows(probs, ref, logp)
            total += float(kld.sum())
            n += kld.size
        return total / max(n, 1)

    @contextmanager
    def _weight(self, t: Tensor | None, s: Setting | None) -> Iterator[None]:
        """``t`` quantized at ``s`` (None: as it is) for what is built and evaluated inside."""
        if t is None or s is None:
            yield
            return
        original = t.module.weight
        t.module.weight = fake_quantized(original, s)
        mx.eval(t.module.weight)  # alone: the rounding's temporaries are freed before the block
        try:
            yield
        finally:
            t.module.weight = original

    def _input(self, t: Tensor, s: Setting) -> mx.array:
        """The first block's input with the embedding ``t`` quantized at ``s``: the model's own
        forward up to the first block (the rest is built and never evaluated)."""
        seen: list[mx.array] = []

        def call(i, block, run, args, kwargs):
            if i == 0:
                seen.append(args[0])
            return args[0]

        with _blocks(self.model, call), self._weight(t, s):
            self.model(self.x)
            mx.eval(seen[0])
        return seen[0]

    def measure(
        self,
        tensors: Sequence[Tensor],
        importance: Callable[[str], Any] | None,
        *,
        progress: Progress | None = None,
    ) -> None:
        """``plan.measure`` in one pass: each planned tensor's weighted errors while its block
        is resident, then its KLs (``importance`` None: the reference log-probs only)."""
        planned = [t for t in tensors if t.fixed is None] if importance is not None else []
        by_block: dict[int, list[Tensor]] = {}
        for t in planned:
            by_block.setdefault(self.place(t), []).append(t)
        outside = by_block.get(-1, []) + by_block.get(self.n_blocks, [])
        variants: list[_Variant] = []
        done = 0

        def measured(ts: Sequence[Tensor]) -> None:
            nonlocal done
            for t in ts:
                assert importance is not None
                measure_errors(t, importance(t.path))
            done += len(ts)
            if progress is not None and ts:
                progress("measuring tensors", done, len(planned))

        def call(j, block, run, args, kwargs):
            x, rest = args[0], args[1:]
            for v in variants:  # (1, L, H) each: the perturbed states so far, through block j
                v.h = run(v.h, *rest, **kwargs)
                mx.eval(v.h)
            for t in by_block.get(j, []):  # block j's tensors: new states from the reference
                for s in probe_settings(t):
                    with self._weight(t, s):
                        h = run(x, *rest, **kwargs)
                        mx.eval(h)
                    variants.append(_Variant(t, s, h))
            out = run(x, *rest, **kwargs)
            mx.eval(out)
            measured(by_block.get(j, []))
            self.resident.release([block])
            return out

        try:
            for t in by_block.get(-1, []):  # the embedding: states from the model's own input
                variants += [_Variant(t, s, self._input(t, s)) for s in probe_settings(t)]
            last = self._drive(call)
            self.reference = list(self._logps(last))
            self.probs = [mx.exp(r) for r in self.reference]
            mx.eval(self.reference, self.probs)
            for t in by_block.get(self.n_blocks, []):  # an untied head: the reference state
                variants += [_Variant(t, s, last) for s in probe_settings(t)]
            kls: dict[str, dict[Setting, float]] = {}
            for v in variants:
                head = v.tensor if v.tensor.module is self.head else None
                with self._weight(head, v.setting):
                    kls.setdefault(v.tensor.path, {})[v.setting] = self._kl(v.h)
                v.h = None  # type: ignore[assignment]
            measured(outside)
            for t in planned:
                set_alpha(t, kls[t.path])
        finally:
            self.resident.release()

    def measure_plan(self, tensors: Sequence[Tensor], settings: dict[str, Setting]) -> float:
        """KL on the probe tokens with every planned tensor quantized (min/max) at once."""
        by_block: dict[int, list[Tensor]] = {}
        for t in tensors:
            if t.path in settings:
                by_block.setdefault(self.place(t), []).append(t)
        outside = by_block.get(-1, []) + by_block.get(self.n_blocks, [])

        def call(j, block, run, args, kwargs):
            with _quantized(by_block.get(j, []), settings):
                out = run(*args, **kwargs)
                mx.eval(out)
            self.resident.release([block])
            return out

        try:
            with _quantized(outside, settings):  # the embedding's input too, when planned
                return self._kl(self._drive(call))
        finally:
            self.resident.release()


@contextmanager
def _quantized(tensors: Sequence[Tensor], settings: dict[str, Setting]) -> Iterator[None]:
    originals = []
    try:
        for t in tensors:
            originals.append((t.module, t.module.weight))
            t.module.weight = fake_quantized(t.module.weight, settings[t.path])
            mx.eval(t.module.weight)  # one at a time: the rounding's temporaries are freed
        yield
    finally:
        for m, w in originals:
            m.weight = w
