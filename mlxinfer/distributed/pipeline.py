"""Pipeline parallelism: each rank runs a contiguous range of the blocks.

The split is applied to a loaded model from the outside, as the CPU backend's layers are:
the family module never learns about ranks. Rank r keeps only its blocks (``layer_ranges``),
the embedding if it is first (or last, with a tied head) and the LM head if it is last; in
their place it holds :class:`Absent` stubs, so the family's own forward still runs on every
rank, with nothing of weight in the parts it does not hold.

A step (one call of the model) on rank r:

1. every rank's input tokens are compared with rank 0's (``Ranks.check_same``): all ranks
   feed the same tokens, or all fail together. A prefill's chunk (a forward under
   :meth:`RankModel.prefilling`, or longer than :data:`SYNC_ROWS`) is not compared at once:
   a checksum of it joins the next comparison, so that no collective ties the ranks together
   during a prefill, and rank 0 runs chunk k+1 while rank 1 runs chunk k (staggered prefill:
   a long prompt's chunks pass through the ranks as through a pipeline);
2. rank r > 0 receives the (B, L, hidden) activations from rank r-1 and evaluates them;
   its first block takes them in place of its input (:class:`Entry`);
3. its blocks run; rank r < last sends its last block's output to rank r+1 (:class:`Exit`);
   one evaluation of the step's graph (activations and cache writes). A lazily built graph
   of several steps deadlocks: ``recv`` has no inputs, so ranks would reach the
   collectives in different orders;
4. the last rank's logits reach every rank (an exact all-sum with zeros elsewhere), so
   that every rank's sampler sees the same numbers and picks the same token (with the
   seed the ranks share). Up to :data:`SYNC_ROWS` positions this happens within the step;
   a prefill's chunk (whose logits nobody reads) leaves it lazy and so never runs.
"""

from __future__ import annotations

import copy
import zlib
from contextlib import contextmanager
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache.kv import Cache
from ..errors import DraftError
from ..generation.drafts import first_blocks
from .group import Ranks

SYNC_ROWS = 64  # positions whose logits are shared within the step (decode, verification)


def kv_nbytes(cache: list) -> int:
    """The bytes ``cache`` holds (a rank's caches, or the batching engine's views of its pool)."""
    return sum(getattr(c, "nbytes", 0) for c in cache)


class Absent(nn.Module):
    """A part of the model this rank does not hold: an embedding gives zeros of the right
    shape, a head returns its input. Neither is ever evaluated. Its ``weight`` has no rows
    (what reads the model's head, such as the CPU backend's plans, finds nothing to plan)."""

    def __init__(self, hidden: int, dtype: mx.Dtype):
        super().__init__()
        self._hidden, self._dtype = hidden, dtype
        self.weight = mx.zeros((0, hidden), dtype=dtype)

    def __call__(self, x: mx.array) -> mx.array:
        if mx.issubdtype(x.dtype, mx.integer):
            return mx.zeros((*x.shape, self._hidden), dtype=self._dtype)  # (B, L, hidden)
        return x


class Entry(nn.Module):
    """The rank's first block, fed the activations received from the rank before."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.incoming: mx.array | None = None

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return self.block(self.incoming, *args, **kwargs)


class Exit(nn.Module):
    """The rank's last block, whose output it keeps for the rank after."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.outgoing: mx.array | None = None

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        self.outgoing = self.block(x, *args, **kwargs)
        return self.outgoing


def local_args(args: Any, layers: range, n_layers: int) -> Any:
    """``args`` for the rank's blocks: ``num_hidden_layers`` and per-layer ``layer_types``
    cut to its range (its caches and masks are made from them)."""
    args = copy.copy(args)
    if hasattr(args, "num_hidden_layers"):
        args.num_hidden_layers = len(layers)
    kinds = getattr(args, "layer_types", None)
    if isinstance(kinds, (list, tuple)) and len(kinds) == n_layers:
        args.layer_types = list(kinds)[layers.start : layers.stop]
    return args


def keep_parts(
    model: nn.Module, ranks: Ranks, layers: range, dtype: mx.Dtype, head_on_first: bool = False
) -> dict:
    """Cut ``model`` (built, unloaded) to this rank's part; returns which of the embedding and
    head it keeps (``{"embedding": bool, "head": bool}``). ``head_on_first``: rank 0 keeps an
    untied LM head too (a self-draft's: :meth:`PipelineModel.first_blocks`)."""
    inner = model[model.inner_name]
    n_layers = len(model.layers)
    hidden = int(model.embedding.weight.shape[-1])
    inner[model.layers_name] = model.layers[layers.start : layers.stop]
    head = ranks.last or (ranks.first and head_on_first)
    keep = {"embedding": ranks.first or (ranks.last and model.tied), "head": head}
    if not keep["embedding"]:
        inner[model.embed_name] = Absent(hidden, dtype)
    if not model.tied and not keep["head"]:
        model.lm_head = Absent(hidden, dtype)
    args = local_args(model.args, layers, n_layers)
    model.args = args
    if getattr(inner, "args", None) is not None:
        inner.args = args
    return keep


class RankModel:
    """What one rank's model shares whatever the split: called as the whole model is, with
    the loaded model's arguments, blocks, caches and parameters."""

    def __init__(self, model: nn.Module, ranks: Ranks):
        self.model, self.ranks = model, ranks
        self.args = model.args
        self.backend = "distributed"  # the prefill runs unscheduled (backends.prefill_schedule)
        self.source_dir = getattr(model, "source_dir", None)
        self.steps = 0

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    def make_cache(self, **kwargs) -> list[Cache]:
        return self.model.make_cache(**kwargs)

    def parameters(self):
        return self.model.parameters()

    def named_modules(self):
        return self.model.named_modules()

    @property
    def positions_from_offset(self) -> bool:
        return getattr(self.model, "positions_from_offset", True)

    @contextmanager
    def prefilling(self) -> Iterator[None]:
        """The forwards of a prefill (``generate``'s chunks, the engine's): their logits are
        never read, so a pipeline neither computes nor shares them (``backends.prefill_schedule``)."""
        self.in_prefill = True
        try:
            yield
        finally:
            self.in_prefill = False

    in_prefill = False

    def engine_turns(self, **options):
        """The batching engine's agreement with the other ranks (``batching.Turns``)."""
        from .batching import Turns

        return Turns(self.ranks, **options)


class PipelineModel(RankModel):
    """The model of one pipeline rank, called as the whole model is: ``model(inputs, cache)
    -> logits (B, L, V)`` on every rank; ``make_cache`` gives the caches of its blocks only."""

    def __init__(
        self,
        model: nn.Module,
        ranks: Ranks,
        layers: range,
        n_layers: int,
        *,
        micro_batches: bool = True,
    ):
        super().__init__(model, ranks)
        self.layers_range, self.n_layers = layers, n_layers
        self._micro_batches = micro_batches  # engines' default: load(micro_batches=)
        blocks = model.layers
        if not ranks.first:
            blocks[0] = self.entry = Entry(blocks[0])
        if not ranks.last:
            blocks[-1] = self.exit = Exit(blocks[-1])

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        r, ranks = self.ranks.rank, self.ranks
        B, L = inputs.shape
        self.steps += 1
        ranks.steps += 1
        step = f"pipeline step {self.steps}"
        share = L <= SYNC_ROWS and not self.in_prefill  # logits someone reads
        self._check_tokens(inputs, step, now=share)
        if not ranks.first:
            h = mx.distributed.recv(
                (B, L, self.activation_width), self.activation_dtype, r - 1, group=ranks.group
            )
            ranks.run(f"{step}: receiving activations", h, peer=r - 1)
            self.entry.incoming = h
        logits = self.model(inputs, cache)
        if ranks.last:
            logits = logits.astype(self.logits_dtype)
        states = [c.state for c in cache] if cache is not None else []
        if cache is not None:
            ranks.kv_bytes = max(ranks.kv_bytes, kv_nbytes(cache))
        if ranks.last:
            todo = [logits, *states] if share else states
            ranks.run(f"{step}: the last blocks", todo, kind="computing")
        else:
            outgoing = self.exit.outgoing.astype(self.activation_dtype)
            sent = mx.distributed.send(outgoing, r + 1, group=ranks.group)
            ranks.run(f"{step}: sending activations", [sent, *states], peer=r + 1, kind="computing")
            self.exit.outgoing = None
        if not ranks.first:
            self.entry.incoming = None
        shared = ranks.all_sum(logits if ranks.last else self._zeros(B, L))
        if share:
            ranks.run(f"{step}: sharing logits", shared, peer=self.ranks.size - 1)
        return shared

    def micro_pipeline(self, wanted: bool | None = None):
        """The flights of micro-batched decode (``micro.py``) for a batching engine, or None:
        ``wanted`` False, or None where loaded with ``micro_batches=False``, or one rank."""
        from .micro import MicroPipeline

        on = self._micro_batches if wanted is None else wanted
        return MicroPipeline(self) if on and self.ranks.size > 1 else None

    def first_blocks(self, n: int) -> PipelineDraft:
        """A self-draft's view (``SelfDraft``): the first ``n`` blocks, which must be rank 0's,
        its final norm and its head (the embedding where tied; else the head rank 0 holds when
        loaded with ``head_on_first``). Refused on every rank alike, before a forward."""
        first = self.first_range
        if not 1 <= n < len(first):
            allowed = f"expected 1 to {len(first) - 1}" if len(first) > 1 else "none allowed"
            raise DraftError(
                f"--self-draft-layers {n} across a pipeline: {allowed} (the drafting blocks "
                f"must be rank 0's, fewer than its {len(first)}: layers "
                f"{first.start}-{first.stop - 1})"
            )
        if not self.head_on_first:
            raise DraftError(
                "--self-draft-layers across a pipeline: rank 0 holds no LM head (an untied head "
                "lives on the last rank: load with head_on_first=True, as the CLI does)"
            )
        return PipelineDraft(first_blocks(self.model, n) if self.ranks.first else None, self, n)

    @property
    def part(self) -> str:
        """This rank's part of the model (the disk prefix tier's files are per part)."""
        r, s, layers = self.ranks.rank, self.ranks.size, self.layers_range
        return f"pipeline rank {r}/{s}: layers {layers.start}-{layers.stop - 1} of {self.n_layers}"

    def _check_tokens(self, inputs: mx.array, step: str, now: bool = True) -> None:
        """Compare ``inputs`` with rank 0's ``now`` (a step whose logits are shared), or fold
        them into the checksum the next such step compares (a prefill chunk: no collective, so
        the ranks stagger)."""
        if not now:
            data = np.asarray(inputs, dtype=np.int32).tobytes()
            self.unchecked = zlib.crc32(data, self.unchecked or 0)
            return
        if self.unchecked is None:
            self.ranks.check_same(inputs, step)
            return
        folded = mx.array([self.unchecked & 0x7FFFFFFF], dtype=mx.int32)
        self.unchecked = None
        self.ranks.check_same(mx.concatenate([inputs.reshape(-1).astype(mx.int32), folded]), step)

    unchecked: int | None = None  # the checksum of the long chunks fed since the last compare

    def _zeros(self, B: int, L: int) -> mx.array:
        return mx.zeros((B, L, self.vocab_rows), dtype=self.logits_dtype)

    # The shapes and dtypes the ranks exchange, fixed at load (``distribute``).
    activation_width: int
    activation_dtype: mx.Dtype
    logits_dtype: mx.Dtype
    vocab_rows: int
    # Rank 0's layers, and whether it holds the LM head (tied, or loaded with head_on_first).
    first_range: range = range(0)
    head_on_first: bool = False


class PipelineDraft:
    """The first blocks of a pipeline, called as the model is: rank 0 runs them with its final
    norm and head, and its logits reach every rank (an exact all-sum), so that every rank draws
    the same drafts with the shared seed (the verification's token check compares them). Each
    call is two evaluations under the watchdog; the other ranks' caches are not touched."""

    def __init__(self, view: nn.Module | None, model: PipelineModel, n: int):
        self.view, self.model, self.n = view, model, n
        self.steps = 0

    def __call__(self, inputs: mx.array, cache: list[Cache]) -> mx.array:
        model, ranks = self.model, self.model.ranks
        self.steps += 1
        step = f"pipeline draft step {self.steps} (the first {self.n} blocks, on rank 0)"
        B, L = inputs.shape
        if self.view is not None:
            logits = self.view(inputs, cache).astype(model.logits_dtype)  # (B, L, V)
            ranks.run(step, [logits, *(c.state for c in cache[: self.n])], kind="computing")
        else:
            logits = mx.zeros((B, L, model.vocab_rows), dtype=model.logits_dtype)
        shared = ranks.all_sum(logits)
        ranks.run(f"{step}: sharing its logits", shared, peer=0)
        return shared
