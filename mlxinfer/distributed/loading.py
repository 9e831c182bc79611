"""Reading a checkpoint for one rank: the loader's steps, with the rank's choice of tensors.

``mx.load`` maps a safetensors file lazily: a tensor's bytes are read when it is evaluated.
So a rank reads every file's header (each checked, as the loader does), keeps the names its
part of the model needs, and evaluates only those: the other layers' bytes are never read.
No index file is needed; a sharded checkpoint's files are simply all listed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from ..config import read_config
from ..loader import default_dtype, load_weights_into, materialize, weight_files
from ..manifest import check_sizes
from ..models import build_model, get_family
from ..models.base import language_model_weights
from ..quant import apply_quantization, quantization_record
from ..safetensors_check import check_safetensors


def build(model_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """The unloaded model (its random parameters stay lazy: never computed) and config."""
    check_sizes(model_dir)
    config = read_config(model_dir)
    return build_model(config, str(model_dir / "config.json")), config


def lazy_weights(
    model_dir: Path, model: nn.Module, config: dict[str, Any], log: Callable | None
) -> dict[str, mx.array]:
    """Every tensor of the checkpoint, unread (lazy), under the names the model uses."""
    weights: dict[str, mx.array] = {}
    for f in weight_files(model_dir):
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
    dtype: mx.Dtype | None | str = "auto",
    record: dict[str, Any] | None = None,
) -> int:
    """Quantize (as the config records, or ``record``), cast, load (strict) and evaluate
    ``weights``; returns the bytes the rank now holds in them."""
    if isinstance(dtype, str):
        dtype = default_dtype()
    record = quantization_record(config) if record is None else record
    if record:
        apply_quantization(model, record, weights)
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    load_weights_into(model, weights, model_dir)
    model.eval()
    model.source_dir = model_dir
    materialize(model)
    return sum(v.nbytes for v in weights.values())
