"""One calibration pass: what each layer sees, and how much the model's output moves.

Two measurements on the float model, both on calibration tokens (never the evaluation text):

* :func:`collect_importance` records, for every layer a recipe may quantize, the sum of
  ``x**2`` over the tokens for each input channel (and how many tokens were counted): the
  "importance matrix" of llama.cpp's ``llama-imatrix``. A stacked-experts layer keeps one row
  per expert and counts only the tokens routed to it. An embedding used as input counts how
  often each row was looked up; used as the tied head, its input channels are recorded like
  a Linear's.
* :func:`calibrate` with ``covariance=True`` also keeps each 2-D layer's input second moment
  ``H = X^T X / n`` (K, K) for GPTQ (``gptq.py``): float32, ``K**2 * 4`` bytes per distinct
  input, since layers that read the same array (q/k/v, gate/up) share one ``H``. SmolLM2-135M:
  30 blocks x (3 x 576**2 + 1536**2) + the head's 576**2 floats = 403 MB, held in memory here;
  the layer-by-layer pass (``layerwise.calibrate``) moves each block's to disk instead
  (``covariances.py``). Stacked experts and per-head matrices keep no ``H`` (their rounding
  falls back to ``mse``).
* :class:`Probe` keeps the float model's log-probs on a few hundred tokens and measures the
  mean KL divergence ``KL(float || model)`` after a change to one tensor (its weight replaced
  by its quantized-then-dequantized values, exactly what the quantized layer multiplies with),
  then restores it.

The layers are recorded by swapping each module's class for a recording subclass during the
pass (``__call__`` is looked up on the class), so parameter paths stay as they are; the
original classes are put back afterwards, also when the pass fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import backends
from ..models.layers.mla import PerHeadLinear
from ..models.layers.moe import SwitchLinear
from .covariances import CovarianceStore

# A layer kind a recipe quantizes, and how its input is recorded.
RECORDED = (nn.Linear, nn.Embedding, SwitchLinear, PerHeadLinear)


def calibration_sequences(
    token_lists: Sequence[Sequence[int]], *, ctx: int, max_tokens: int, bos: int | None = None
) -> list[list[int]]:
    """Cut the documents' tokens (joined in order) into sequences of ``ctx`` tokens, at most
    ``max_tokens`` in all; a sequence's first token is ``bos`` when the tokenizer adds one (as
    the perplexity protocol does). A last partial sequence of at least ``ctx // 4`` is kept."""
    flat = [t for tokens in token_lists for t in tokens][:max_tokens]
    out = [list(flat[i : i + ctx]) for i in range(0, len(flat), ctx)]
    out = [s for s in out if len(s) >= max(ctx // 4, 2)]
    if bos is not None:
        for s in out:
            s[0] = bos
    return out


class _Recorder:
    """Sums of ``x**2`` per input channel and token counts, per module path (mx arrays,
    evaluated after each sequence so the graph stays one forward pass long); with
    ``covariance``, sums of ``x x^T`` too, one per distinct input array."""

    def __init__(self, covariance: bool = False, store: CovarianceStore | None = None) -> None:
        self.sums: dict[str, mx.array] = {}
        self.counts: dict[str, mx.array] = {}
        self.covariance = covariance
        self.store = store  # where spill() moves the sums of x x^T (None: kept here)
        self.xtx: dict[str, mx.array] = {}  # first reader's path -> sum of x x^T (K, K)
        self.tokens: dict[str, int] = {}
        self.shares: dict[str, str] = {}  # path -> the path whose sum it shares
        # id(input) -> (input, path), this sequence's: the array is held so its id stays unique
        self.inputs: dict[int, tuple[mx.array, str]] = {}

    def add(self, path: str, sums: mx.array, counts: mx.array) -> None:
        if path in self.sums:
            sums, counts = self.sums[path] + sums, self.counts[path] + counts
        self.sums[path], self.counts[path] = sums, counts

    def linear(self, path: str, x: mx.array, covariance: bool = True) -> None:
        flat = x.astype(mx.float32).reshape(-1, x.shape[-1])  # (tokens, K)
        self.add(path, mx.square(flat).sum(axis=0), mx.array(flat.shape[0], mx.int64))
        if self.covariance and covariance:
            self.second_moment(path, x, flat)

    def second_moment(self, path: str, x: mx.array, flat: mx.array) -> None:
        """Add ``flat^T flat`` to ``path``'s sum, or note that ``path`` read the same array as
        a layer recorded before it in this pass (q/k/v, gate/up): one sum for both."""
        seen = self.inputs.get(id(x))
        if seen is not None and seen[0] is x:
            self.shares[path] = seen[1]
            return
        self.inputs[id(x)] = (x, path)
        self.shares[path] = path
        xtx = flat.T @ flat  # (K, K)
        self.xtx[path] = self.xtx[path] + xtx if path in self.xtx else xtx
        self.tokens[path] = self.tokens.get(path, 0) + flat.shape[0]

    def rows(self, path: str, ids: mx.array, n_rows: int) -> None:
        """An embedding lookup: how often each row was read (the row's importance)."""
        ids = ids.reshape(-1)
        counts = mx.zeros((n_rows,), mx.float32).at[ids].add(1.0)
        self.add(path + "#rows", counts, mx.array(ids.size, mx.int64))

    def experts(self, path: str, x: mx.array, indices: mx.array, n_experts: int) -> None:
        """x (..., 1, K) broadcast against indices (...): each (token, expert) pair's x**2
        summed into that expert's row; counts per expert."""
        k = x.shape[-1]
        x = mx.broadcast_to(x, (*indices.shape, 1, k)).reshape(-1, k).astype(mx.float32)
        onehot = (indices.reshape(-1, 1) == mx.arange(n_experts)).astype(mx.float32)  # (M, E)
        self.add(path, onehot.T @ mx.square(x), onehot.sum(axis=0).astype(mx.int64))

    def evaluate(self, *also) -> None:
        """Evaluate the sums (and ``also``, in the same pass: a block's output, say)."""
        mx.eval(also, list(self.sums.values()), list(self.counts.values()), list(self.xtx.values()))
        self.inputs.clear()

    def spill(self) -> None:
        """The evaluated sums of ``x x^T`` added to the store's files and dropped here."""
        if self.store is not None:
            for p in list(self.xtx):
                self.store.add(p, self.xtx.pop(p))

    def statistics(self) -> Statistics:
        sums = {p: np.array(a, dtype=np.float32) for p, a in self.sums.items()}
        counts = {p: np.array(a, dtype=np.int64) for p, a in self.counts.items()}
        if self.store is not None:
            self.spill()
            self.store.finish(self.shares, self.tokens)
            return Statistics(sums, counts, self.store)
        means = {}
        for p, a in list(self.xtx.items()):
            means[p] = np.array(a, dtype=np.float32) / max(self.tokens[p], 1)
            del self.xtx[p]  # one copy at a time
        covariances = {p: means[first] for p, first in self.shares.items()}
        return Statistics(sums, counts, covariances)


def _recording_class(cls: type, recorder: _Recorder, paths: dict[int, str]) -> type:
    """A subclass of ``cls`` whose calls record their inputs into ``recorder``."""
    if issubclass(cls, nn.Embedding):

        def call(self, x):
            recorder.rows(paths[id(self)], x, self.weight.shape[0])
            return cls.__call__(self, x)

        def as_linear(self, x):
            recorder.linear(paths[id(self)], x)
            return cls.as_linear(self, x)

        return type(f"Recording{cls.__name__}", (cls,), {"__call__": call, "as_linear": as_linear})
    if issubclass(cls, SwitchLinear):

        def call(self, x, indices, sorted_indices=False):
            recorder.experts(paths[id(self)], x, indices, self.weight.shape[0])
            return cls.__call__(self, x, indices, sorted_indices)

    elif issubclass(cls, PerHeadLinear):

        def call(self, x, transpose=True):
            if transpose:  # x (..., in): the stored matrices' input side (no H: 3-D weights)
                recorder.linear(paths[id(self)], x, covariance=False)
            return cls.__call__(self, x, transpose)

    else:

        def call(self, x):
            recorder.linear(paths[id(self)], x)
            return cls.__call__(self, x)

    return type(f"Recording{cls.__name__}", (cls,), {"__call__": call})


@contextmanager
def _recording(model: nn.Module, recorder: _Recorder) -> Iterator[None]:
    # Float layers only: quantized ones (an MXFP4 checkpoint's experts) keep their format.
    modules = [
        (p, m) for p, m in model.named_modules() if isinstance(m, RECORDED) and "scales" not in m
    ]
    paths = {id(m): p for p, m in modules}
    originals = [(m, type(m)) for _, m in modules]
    made: dict[type, type] = {}
    try:
        for m, cls in originals:
            if cls not in made:
                made[cls] = _recording_class(cls, recorder, paths)
            m.__class__ = made[cls]
        yield
    finally:
        for m, cls in originals:
            m.__class__ = cls


BlockCall = Callable[[int, nn.Module, Callable[..., Any], tuple, dict], Any]


@contextmanager
def hooked_blocks(blocks: Sequence[nn.Module], call: BlockCall) -> Iterator[None]:
    """Each block's ``__call__`` becomes ``call(index, block, run, args, kwargs)``, ``run`` the
    block's own call (the class is swapped for a subclass: ``__call__`` is looked up on the
    class); the classes are put back afterwards, also when the pass fails."""
    index = {id(b): i for i, b in enumerate(blocks)}
    originals = [(b, type(b)) for b in blocks]
    made: dict[type, type] = {}
    # The made classes live in reference cycles (as every class does) until the garbage
    # collector runs: they reach ``call`` (and what it holds: modules whose weights a later
    # step evaluates) only through this list, emptied on the way out.
    calls = [call]
    try:
        for b, cls in originals:
            if cls not in made:

                def forward(block, *args, _cls=cls, **kwargs):
                    def run(*a, **k):
                        return _cls.__call__(block, *a, **k)

                    return calls[0](index[id(block)], block, run, args, kwargs)

                made[cls] = type(f"Hooked{cls.__name__}", (cls,), {"__call__": forward})
            b.__class__ = made[cls]
        yield
    finally:
        for b, cls in originals:
            b.__class__ = cls
        calls.clear()


@dataclass
class Statistics:
    """What one calibration pass recorded, per module path.

    ``sums[path]``: float32 (K,) sum of ``x**2`` per input channel ((E, K) for stacked experts);
    ``counts[path]``: int64 () tokens ((E,) per expert). An embedding's lookups are under
    ``"<path>#rows"``: how often each row was read, and the tokens. ``covariances[path]``:
    float32 (K, K) mean of ``x x^T`` (the tied head's under the embedding's path), one array
    object shared by the layers that read the same input; empty unless asked for (a
    ``CovarianceStore`` on disk from the layer-by-layer pass).
    """

    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]
    covariances: Mapping[str, np.ndarray] = field(default_factory=dict)


def calibrate(
    model: nn.Module, sequences: Sequence[Sequence[int]], *, covariance: bool = False, progress=None
) -> Statistics:
    """Run ``model`` on each sequence, recording every quantizable layer's inputs."""
    recorder = _Recorder(covariance)
    with _recording(model, recorder):
        for i, seq in enumerate(sequences):
            logits = model(mx.array(seq)[None])
            mx.eval(logits)
            recorder.evaluate()
            if progress is not None:
                progress("calibration", i + 1, len(sequences))
    return recorder.statistics()


def collect_importance(
    model: nn.Module, sequences: Sequence[Sequence[int]], *, progress=None
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Run ``model`` on each sequence; returns ``(sums, counts)`` per module path
    (:class:`Statistics`)."""
    stats = calibrate(model, sequences, progress=progress)
    return stats.sums, stats.counts


def kl_rows(probs: mx.array, ref: mx.array, logp: mx.array) -> mx.array:
    """KL(reference || model) per row: ``sum_v p (log p - log q)`` from the reference's
    probabilities ``probs`` (its ``exp``, made once), its log-probs and the model's."""
    return (probs * (ref - logp)).sum(axis=-1)


class Probe:
    """The float model's log-probs on ``sequences``, to measure ``KL(float || changed)``.

    A change inside block ``i`` leaves blocks ``0 .. i-1`` as they were, so their outputs on
    the probe tokens are kept from the reference pass and replayed (the blocks' classes are
    swapped for replaying subclasses during a measurement): a probe of a late layer costs the
    late blocks and the head, not the whole model.
    """

    def __init__(self, model: nn.Module, sequences: Sequence[Sequence[int]], vocab: int):
        self.model, self.vocab = model, vocab
        self.inputs = [mx.array(s)[None] for s in sequences]
        blocks = getattr(model, "layers", None)
        self.blocks: list[nn.Module] = list(blocks) if isinstance(blocks, list) else []
        self.block_of = {id(m): i for i, b in enumerate(self.blocks) for _, m in b.named_modules()}
        self.kept: list[list[object]] = [[] for _ in self.inputs]  # per sequence, per block
        self.replay_below = 0  # blocks below this index return their kept output
        self.sequence = 0
        with self._blocks("record"):
            self.reference = [self._logp(x) for x in self.inputs]
        self.probs = [mx.exp(r) for r in self.reference]
        mx.eval(self.reference, self.probs, self.kept)

    @contextmanager
    def _blocks(self, mode: str) -> Iterator[None]:
        def call(i, block, run, args, kwargs):
            kept = self.kept[self.sequence]
            if mode == "replay" and i < self.replay_below:
                return kept[i]
            out = run(*args, **kwargs)
            if mode == "record":
                kept.append(out)
            return out

        with hooked_blocks(self.blocks, call):
            yield

    def _logp(self, x: mx.array) -> mx.array:
        return backends.log_probs(self.model(x)[0, :, : self.vocab].astype(mx.float32))  # (L, V)

    def kl(self, first_block: int = 0) -> float:
        """Mean KL divergence per token of the model as it is now from the reference, with
        the blocks below ``first_block`` replayed from the reference pass."""
        total, n = 0.0, 0
        self.replay_below = first_block
        with self._blocks("replay"):
            for k, (x, ref, probs) in enumerate(zip(self.inputs, self.reference, self.probs)):
                self.sequence = k
                kld = kl_rows(probs, ref, self._logp(x))
                total += float(kld.sum())
                n += kld.size
        return total / max(n, 1)

    def kl_with(self, module: nn.Module, weight: mx.array) -> float:
        """KL with ``module.weight`` replaced by ``weight`` for the measurement."""
        original = module.weight
        module.weight = weight
        try:
            return self.kl(self.block_of.get(id(module), 0))
        finally:
            module.weight = original
