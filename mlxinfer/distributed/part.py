"""``load(path, distributed="pipeline"|"tensor")`` on each rank: this rank's part of the model.

:func:`load` is ``mlxinfer.load(path, distributed=...)``: the loader's way to the model's
directory (a Hub repo, a ``.gguf``, the default model), then :func:`load_model` here.

The CPU backend's two-stream plans are forced off first (``MLXINFER_CPU_PLANS=single``: one
stream, the compiled kernels where built): they spread products over two worker streams, and
collectives issued from two streams corrupt each other. The kernels run on MLX's one CPU stream.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import backends
from ..errors import DistributedError
from ..loading.loader import (
    check_vocabulary,
    default_dtype,
    load_weights_into,
    open_model,
    weight_files,
)
from ..quant.transform import quantization_record
from . import reading as loading
from .experts import expert_share
from .group import Ranks
from .pipeline import PipelineModel, keep_parts
from .placement import WeightNames, layer_ranges, quantized_split_reason, tensor_split_reason
from .recurrent import recurrent_share
from .tensor import TensorModel, shard, sum_outputs

MODES = ("pipeline", "tensor")
_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _one_stream(log: Callable[[str], None] | None) -> None:
    if backends.name() != "cpu":
        return
    from ..backends.cpu import plans

    if os.environ.get(plans.ENV) == "off":
        return
    if log is not None:
        log(
            f"distributed: the CPU backend's two-stream plans are off ({plans.ENV}=single: one "
            "stream, the compiled kernels where built)"
        )
    os.environ[plans.ENV] = "single"


def load(
    path_or_repo: str | os.PathLike | None = None,
    distributed: str = "pipeline",
    *,
    rank_timeout: float | None = None,
    rank_memory: str | list[int] | None = None,
    micro_batches: bool = True,
    head_on_first: bool = False,
    dtype: mx.Dtype | None | str = "auto",
    log: Callable[[str], None] | None = None,
):
    """This rank's part of the model ``path_or_repo`` names (as ``mlxinfer.load``'s), and the
    tokenizer: ``(model, tokenizer)``, run across the ranks of MLX's environment.

    Args:
        distributed: "pipeline" (each rank a range of layers) or "tensor" (each rank a share
            of every layer's heads; the pipeline where the sizes do not divide).
        rank_timeout: seconds any step may wait on the other ranks (None: the watchdog's
            default, ``DEFAULT_RANK_TIMEOUT``).
        rank_memory: the pipeline's layers in proportion to each rank's memory: "auto", or
            bytes (one figure, or one per rank); None: by count (docs/distributed.md).
        micro_batches: whether a batching engine over a pipeline decodes in flights of rows,
            one at each rank's stage, unless the engine says otherwise
            (``Engine(micro_batches=)``).
        head_on_first: a pipeline's rank 0 holds an untied LM head too (self-drafting with its
            first blocks, ``SelfDraft``; a tied head is there anyway).
        dtype, log: as ``mlxinfer.load``'s.
    """
    from ..tokenization import Tokenizer
    from .group import current

    def load_dir(model_dir: Path):
        model = load_model(
            model_dir,
            distributed,
            current(rank_timeout),
            files=weight_files(model_dir),
            load_weights=load_weights_into,
            dtype=default_dtype() if isinstance(dtype, str) else dtype,
            log=log,
            rank_memory=rank_memory,
            head_on_first=head_on_first,
            micro_batches=micro_batches,
        )
        return model, check_vocabulary(model, Tokenizer.from_dir(model_dir), log=log)

    return open_model(path_or_repo, load_dir, log=log)


def load_model(
    model_dir: Path,
    mode: str,
    ranks: Ranks,
    *,
    files: list[Path],
    load_weights: Callable,
    dtype: mx.Dtype | None = None,
    log: Callable[[str], None] | None = None,
    rank_memory: str | list[int] | None = None,
    head_on_first: bool = False,
    micro_batches: bool = True,
):
    """This rank's model for ``mode``: a :class:`PipelineModel` or a :class:`TensorModel`,
    called as the whole model is. ``mode="tensor"`` falls back to the pipeline, with one
    line to ``log``, where the model's sizes do not divide over the ranks. ``files``: the
    checkpoint's safetensors files; ``load_weights``: the loader's strict
    ``load_weights_into``. ``rank_memory``: the pipeline's layer ranges in proportion to each
    rank's memory: ``"auto"`` (what each machine can give now), or bytes, one figure for
    every rank or one per rank (the same list on every rank); None: by layer count.
    ``head_on_first``: a pipeline's rank 0 holds an untied LM head too, for self-drafting with
    its first blocks (``PipelineModel.first_blocks``). ``micro_batches``: a pipeline's batching
    engines decode in flights unless they say otherwise (``PipelineModel.micro_pipeline``)."""
    if mode not in MODES:
        raise DistributedError(f"distributed={mode!r}: expected one of {', '.join(MODES)}")
    model_dir = Path(model_dir)
    _one_stream(log)
    read = {"files": files, "load_weights": load_weights, "dtype": dtype, "log": log}
    model, config = loading.build(model_dir)
    if mode == "tensor":
        reason = tensor_split_reason(model, ranks.size)
        if reason is None and (record := quantization_record(config)):
            reason = quantized_split_reason(model, record, ranks.size)
        if reason is None:
            return _tensor(model, config, model_dir, ranks, **read)
        if log is not None and ranks.first:
            log(f"distributed: tensor parallelism falls back to the pipeline: {reason}")
    shares = _shares(ranks, rank_memory)
    return _pipeline(
        model,
        config,
        model_dir,
        ranks,
        shares=shares,
        head_on_first=head_on_first,
        micro_batches=micro_batches,
        **read,
    )


def _shares(ranks: Ranks, rank_memory: str | list[int] | None) -> list[int] | None:
    """Each rank's memory in MiB (``rank_memory``, see ``load_model``), the same on every
    rank, or None (layer ranges by count)."""
    if rank_memory is None:
        return None
    if rank_memory == "auto":
        from ..loading import memory

        room = memory.capacity(memory.recommended_working_set())
        if room is None:
            raise DistributedError("rank_memory='auto': this machine's free memory is unknown")
        mine = mx.zeros((ranks.size,), dtype=mx.int32)
        mine[ranks.rank] = max(1, min(room.bytes >> 20, (1 << 31) - 1))
        table = ranks.all_sum(mine)
        ranks.run("sharing each rank's memory", table)
        return table.tolist()
    sizes = list(rank_memory) if isinstance(rank_memory, (list, tuple)) else None
    if (
        not sizes
        or len(sizes) not in (1, ranks.size)
        or not all(isinstance(b, int) and b > 0 for b in sizes)
    ):
        raise DistributedError(
            f"rank_memory: expected 'auto', or positive sizes in bytes: one for every rank or "
            f"one per rank ({ranks.size}), found {rank_memory!r:.80}"
        )
    return [max(1, b >> 20) for b in sizes * (ranks.size // len(sizes))]


def _tensor(model, config, model_dir, ranks, *, files, load_weights, dtype, log) -> TensorModel:
    tensor_heads = _heads(model)
    # before the cut: the whole sizes
    shares = expert_share(model, ranks.rank, ranks.size) + recurrent_share(
        model, ranks.rank, ranks.size
    )
    weights = loading.lazy_weights(files, model_dir, model, config, log)
    loading.load_into(model, weights, config, model_dir, dtype, load_weights, evaluate=False)
    del weights  # the model holds the (lazy) tensors now; after the cut, only its share
    summed = shard(model, ranks)
    loading.evaluate_all(model)
    backends.apply(model, log=log)
    sum_outputs(summed, ranks)
    ranks.broadcast_pair(0, 0)  # every rank loaded (the long wait: group.LOAD_WAIT_S)
    wrapper = TensorModel(model, ranks)
    wrapper.weight_bytes = ranks.weight_bytes = _nbytes(model)
    if log is not None:
        (n, kind), s, r = tensor_heads, ranks.size, ranks.rank
        runs = f"heads {r * n // s}-{(r + 1) * n // s - 1} of {n} in every {kind}{shares}"
        runs = runs if n else shares.removeprefix(" and ")  # no attention layer
        log(
            f"distributed: rank {r}/{s} runs {runs} ({wrapper.weight_bytes / 1e6:.1f} MB of "
            "weights)"
        )
    return wrapper


def _pipeline(
    model,
    config,
    model_dir,
    ranks,
    *,
    files,
    load_weights,
    dtype,
    log,
    shares=None,
    head_on_first=False,
    micro_batches=True,
) -> PipelineModel:
    names = WeightNames(model)
    n_layers = len(model.layers)
    layers = layer_ranges(n_layers, ranks.size, shares)[ranks.rank]
    hidden = int(model.embedding.weight.shape[-1])  # built, not yet loaded: never packed
    weights = loading.lazy_weights(files, model_dir, model, config, log)
    keep = keep_parts(model, ranks, layers, dtype or mx.float32, head_on_first)
    weights = names.for_pipeline(weights, layers, **keep)
    weights.update(  # the stubs' empty weights (pipeline.Absent)
        (k, v) for k, v in tree_flatten(model.parameters()) if v.size == 0 and k not in weights
    )
    record = quantization_record(config)
    if record:  # per-layer entries name the blocks by their number in the whole model
        record = {names.renumber(k, layers): v for k, v in record.items()}
        record = {k: v for k, v in record.items() if k is not None}
    loading.load_into(model, weights, config, model_dir, dtype, load_weights, record, False)
    del weights  # the model holds the tensors: each is read, then held once
    loading.evaluate_all(model)
    backends.apply(model, log=log)
    wrapper = PipelineModel(model, ranks, layers, n_layers, micro_batches=micro_batches)
    wrapper.first_range = layer_ranges(n_layers, ranks.size, shares)[0]  # the same everywhere
    wrapper.head_on_first = model.tied or head_on_first
    # The ranks agree on what they exchange: rank 0's float dtype, the last rank's head rows.
    code = _DTYPES.index(_float_dtype(model)) if ranks.first else 0
    rows = int(model.head.weight.shape[0]) if ranks.last else 0
    code, rows = ranks.broadcast_pair(code, rows)
    wrapper.activation_dtype = wrapper.logits_dtype = _DTYPES[code]
    wrapper.activation_width = hidden
    wrapper.vocab_rows = rows
    wrapper.weight_bytes = ranks.weight_bytes = _nbytes(model)
    if log is not None:
        log(
            f"distributed: rank {ranks.rank}/{ranks.size} runs layers {layers.start}-"
            f"{layers.stop - 1} of {n_layers} ({wrapper.weight_bytes / 1e6:.1f} MB of weights)"
        )
    return wrapper


def _heads(model: nn.Module) -> tuple[int, str]:
    """The attention heads of the model's attention layers, and "layer" or, in a hybrid model
    (where some layers are recurrent), "attention layer"."""
    from ..models.layers.attention import RopeAttention
    from ..models.layers.mla import MultiHeadLatentAttention

    kinds = (RopeAttention, MultiHeadLatentAttention)
    heads = [m.n_heads for b in model.layers for m in b.children().values() if isinstance(m, kinds)]
    kind = "layer" if len(heads) == len(model.layers) else "attention layer"
    return (heads[0] if heads else 0), kind


def _float_dtype(model: nn.Module) -> mx.Dtype:
    for _, v in tree_flatten(model.layers[0].parameters()):
        if v.dtype in _DTYPES:
            return v.dtype
    return mx.float32


def _nbytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
