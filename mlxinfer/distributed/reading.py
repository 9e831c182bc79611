"""Reading a checkpoint for one rank: the loader's steps, with the rank's choice of tensors.

``mx.load`` maps a safetensors file lazily: a tensor's bytes are read when it is evaluated.
So a rank reads every file's header (each checked, as the loader does), keeps the names its
part of the model needs, and evaluates only those: the other layers' bytes are never read.
No index file is needed; a sharded checkpoint's files are simply all listed.

``part.load`` hands these steps the checkpoint's file list and the loader's strict
``load_weights_into``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..files.manifest import check_sizes
from ..files.safetensors_check import check_safetensors
from ..models import build_model, get_family
from ..models.base import language_model_weights
from ..models.config import read_config
from ..quant.transform import apply_quantization, quantization_record


def build(model_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """The unloaded model (its random parameters stay lazy: never computed) and config."""
    check_sizes(model_dir)
    config = read_config(model_dir)
    return build_model(config, str(model_dir / "config.json")), config


def lazy_weights(
    files: list[Path],
    model_dir: Path,
    model: nn.Module,
    config: dict[str, Any],
    log: Callable | None,
) -> dict[str, mx.array]:
    """Every tensor of the checkpoint's ``files``, unread (lazy), under the model's names."""
    weights: dict[str, mx.array] = {}
    for f in files:
        check_safetensors(f)
        weights.update(mx.load(str(f)))
    if config.get("language_model_of"):
        if log is not None:
            log(f"{model_dir}: running the language model of a {config['language_model_of']}")
        weights = language_model_weights(weights)
    source = str(model_dir / "config.json")
    return get_family(config, source).Model.sanitize(weights, model.args)


def load_into(
    model: nn.Module,
    weights: dict[str, mx.array],
    config: dict[str, Any],
    model_dir: Path,
    dtype: mx.Dtype | None,
    load_weights: Callable,
    record: dict[str, Any] | None = None,
    evaluate: bool = True,
) -> None:
    """Quantize (as the config records, or ``record``), cast, load with ``load_weights``
    (the loader's strict ``load_weights_into``) and (``evaluate``) evaluate ``weights``:
    tensor parallelism first cuts them to the rank's share, then evaluates (:func:`evaluate`)."""
    record = quantization_record(config) if record is None else record
    if record:
        apply_quantization(model, record, weights)
    if dtype is not None:  # (a cast to the same dtype would copy: both alive at evaluation)
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype else v
            for k, v in weights.items()
        }
    load_weights(model, weights, model_dir)
    model.eval()
    model.source_dir = model_dir
    if evaluate:
        evaluate_all(model)


def evaluate_all(model: nn.Module) -> None:
    """Every array the model holds, evaluated (as loader.materialize: weights, RoPE tables),
    one block at a time: a tensor read whole to be cut to a rank's share is freed before the
    next block's are read."""
    for block in model.layers:
        mx.eval([v for _, v in tree_flatten(block) if isinstance(v, mx.array)])
    mx.eval([v for _, v in tree_flatten(model) if isinstance(v, mx.array)])
