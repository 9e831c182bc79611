"""Find a model, read its config and weights, build the model and tokenizer.

Weights are read only from safetensors files (never pickle). Every file is
checked before MLX maps it, by the safetensors library's rules (safetensors_check.py):
a header that does not parse, a shape that does not match its bytes, or data shorter
than the header promises (a truncated download), is a one-line error.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import backends
from ..errors import ConfigError, WeightsError
from ..files.manifest import check_sizes
from ..files.safetensors_check import check_safetensors, index_files, inside
from ..models import build_model, get_family
from ..models.base import embedding_rows, language_model_weights
from ..models.config import read_config, without_tower
from ..models.layers.mtp import HEAD_FILE
from ..platform.machine import user_cache_dir
from ..platform.memory import release_free_heap
from ..platform.progress import Progress
from ..platform.threads import release_at_thread_exit
from ..quant.transform import apply_quantization, quantization_record
from . import memory

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.tiktoken", "*.txt"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# The model store's layout (mlxinfer/store, which imports loading, so it is defined here):
# <cache>/store/<org>/<name>/<variant>, lower case; no org is "library", no variant "latest".
STORE_DIR = "store"
_STORE_NAME = re.compile(
    r"^(?:(?P<org>[A-Za-z0-9][A-Za-z0-9_.-]{0,95})/)?(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]{0,95})"
    r"(?::(?P<variant>[A-Za-z0-9][A-Za-z0-9_.-]{0,63}))?\Z"
)


def store_path(name: str, root: Path | None = None) -> Path | None:
    """The directory the store keeps the model ``name`` in (``org/name[:variant]``; ``name`` is
    ``library/name:latest``), whether or not it is there; None when ``name`` is not a store name
    (``..`` included). ``root``: the cache root, default :func:`user_cache_dir`."""
    m = _STORE_NAME.match(name)
    if m is None or ".." in name:
        return None
    parts = (m["org"] or "library", m["name"], m["variant"] or "latest")
    return (root or user_cache_dir()) / STORE_DIR / Path(*(p.lower() for p in parts))


def resolve_model_path(path_or_repo: str | os.PathLike, *, revision: str | None = None) -> Path:
    """A local directory as is; else a model in the store (:func:`store_path`); otherwise a Hub
    repo id, fetched into the HF cache.

    ``HF_HUB_OFFLINE=1`` makes the Hub lookup use only the local cache.
    """
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    name = str(path_or_repo)
    stored = store_path(name)
    if revision is None and stored is not None and (stored / "config.json").is_file():
        return stored  # pulled into the store (mlxinfer/store): before the Hub
    if not _REPO_ID.match(name):
        raise ConfigError(
            f"{name}: no such file or directory, and not a Hub repo id (expected 'org/name')"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"{name}: not in the local Hugging Face cache and the Hub cannot be reached "
            "(offline); download it first or pass a local directory"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ConfigError(
            f"{name}: Hub download failed ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from None


# A quantized model's calibration statistics (convert's plans), saved beside its weights for
# reuse with --imatrix; not a weight file.
IMATRIX_NAME = "imatrix.safetensors"
# Files beside the weights that are not the model's: the calibration statistics and a head
# trained by ``mlxinfer train-mtp`` (models/layers/mtp.py HEAD_FILE).
SIDE_FILES = (IMATRIX_NAME, HEAD_FILE)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, following an index when there is one (each file
    checked to lie inside ``model_dir``: safetensors_check.inside)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return index_files(model_dir, index)
    files = [
        inside(model_dir, f.name, model_dir)
        for f in sorted(model_dir.glob("*.safetensors"))
        if f.name not in SIDE_FILES
    ]
    if not files:
        pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise WeightsError(
                f"{model_dir}: only pickle weights ({', '.join(pickles)}); mlxinfer never "
                "unpickles (it can run code) — save the checkpoint as safetensors"
            )
        raise WeightsError(f"{model_dir}: no *.safetensors weight files")
    return files


def read_weights(model_dir: Path, progress: Progress | None = None) -> dict[str, mx.array]:
    """Every tensor of the directory's safetensors files; ``progress("reading weights", bytes
    read, total bytes)`` after each file (from 0)."""
    weights: dict[str, mx.array] = {}
    files = weight_files(model_dir)
    total, done = sum(f.stat().st_size for f in files), 0
    if progress is not None:
        progress("reading weights", 0, total)
    for f in files:
        check_safetensors(f)
        weights.update(mx.load(str(f)))
        done += f.stat().st_size
        if progress is not None:
            progress("reading weights", done, total)
    return weights


def headless_embedding(model: nn.Module, weights: dict[str, mx.array], model_dir: Path) -> bool:
    """An embedding checkpoint (sentence-transformers' modules.json) whose weights have no LM
    head for an untied model. Only these load without one: a generative checkpoint lacking
    ``lm_head.weight`` is still a missing weight (:func:`load_weights_into`)."""
    return (
        "lm_head" in model
        and not any(k.startswith("lm_head.") for k in weights)
        and (model_dir / "modules.json").is_file()
    )


def weights_source(model_dir: Path) -> Path:
    """What a weight error names: the index, else the one weights file, else the directory."""
    index = model_dir / "model.safetensors.index.json"
    files = [f for f in model_dir.glob("*.safetensors") if f.name not in SIDE_FILES]
    return index if index.is_file() else files[0] if len(files) == 1 else model_dir


# Weights of quantization formats other than MLX's (HF checkpoints made by AutoGPTQ/GPTQModel,
# AutoAWQ, bitsandbytes, FP8 and compressed-tensors): named in the error instead of "unexpected".
FOREIGN_QUANT = {
    ".qweight": "GPTQ/AWQ packed (qweight)",
    ".qzeros": "GPTQ/AWQ packed (qzeros)",
    ".g_idx": "GPTQ's group index (g_idx)",
    ".weight_scale_inv": "FP8 block-quantized (weight_scale_inv)",
    ".weight_scale": "FP8/compressed-tensors (weight_scale)",
    ".weight_packed": "compressed-tensors packed (weight_packed)",
    ".SCB": "bitsandbytes int8 (SCB)",
    ".absmax": "bitsandbytes 4-bit (absmax)",
}


def load_weights_into(model: nn.Module, weights: dict[str, mx.array], source: Path) -> None:
    """Load with a clear error for any unexpected, missing or mis-shaped key."""
    if (drop_absent_heads := getattr(model, "drop_absent_heads", None)) is not None:
        drop_absent_heads(weights)  # MTP heads the config announces but whose weights were stripped
    params = dict(tree_flatten(model.parameters()))
    for key, value in weights.items():
        if key not in params:
            foreign = next((f for suffix, f in FOREIGN_QUANT.items() if key.endswith(suffix)), None)
            if foreign is not None:
                raise WeightsError(
                    f"{source}: weight '{key}' is {foreign}, not MLX's quantization format; "
                    "expected float weights or an MLX record (mlx-lm's, ours, a GGUF): "
                    "dequantize the checkpoint to float first, then mlxinfer convert -q"
                )
            raise WeightsError(f"{source}: unexpected weight '{key}' for this model_type")
        if value.shape != params[key].shape:
            raise WeightsError(
                f"{source}: weight '{key}' has shape {tuple(value.shape)}, "
                f"expected {tuple(params[key].shape)}"
            )
    missing = sorted(set(params) - set(weights))
    if missing:
        raise WeightsError(
            f"{source}: missing weight '{missing[0]}'"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    model.load_weights(list(weights.items()), strict=True)


def default_dtype() -> mx.Dtype | None:
    """The float dtype to compute in when the caller names none.

    On the CPU backend float32: MLX's float16/bfloat16 CPU kernels (dense and
    quantized) are many times slower than float32, and float16 overflows on
    some families. For quantized weights only scales, biases and norms widen.
    Elsewhere (Metal) None: the checkpoint's own dtypes.
    """
    return mx.float32 if mx.default_device().type == mx.DeviceType.cpu else None


# Where a model with a vision tower keeps it (its attribute, in its weights' names):
# Gemma 3's ``vision_tower``, Qwen-VL's ``visual``, Idefics3's ``vision_model``.
_TOWERS = ("vision_tower", "visual", "vision_model")


def load_model(
    model_dir: Path,
    *,
    dtype: mx.Dtype | None | str = "auto",
    log: Callable[[str], None] | None = None,
    progress: Progress | None = None,
    force: bool = False,
    kv_budget: int | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Build the model in ``model_dir`` and load its weights (evaluated: see :func:`materialize`).

    ``dtype``: cast float weights to it; None keeps the stored dtypes; "auto"
    is :func:`default_dtype`. ``progress``: see :mod:`mlxinfer.platform.progress`. ``force``: load
    even when the weights and ``kv_budget`` exceed the memory the machine can give
    (:func:`check_fits`).
    """
    release_at_thread_exit()
    if isinstance(dtype, str):
        dtype = default_dtype()
    model_dir = Path(model_dir)
    check_sizes(model_dir)  # a file truncated or grown since conversion (manifest.py); a stat each
    config = read_config(model_dir)
    source = str(model_dir / "config.json")
    model = build_model(config, source)
    if not force:
        check_fits(model_dir, model.args, dtype, kv_budget)
    weights = read_weights(model_dir, progress)
    tower = next((name for name in _TOWERS if hasattr(model, name)), None)
    if tower is not None and not any(f"{tower}." in k for k in weights):
        if log is not None:
            log(f"{model_dir}: no vision tower weights: running its language model alone")
        config = without_tower(config)
        model = build_model(config, source)
    if config.get("language_model_of"):
        if log is not None:
            log(
                f"{model_dir}: a {config['language_model_of']} checkpoint: running its language "
                "model; the vision tower is not loaded"
            )
        weights = language_model_weights(weights)
    weights = get_family(config, source).Model.sanitize(weights, model.args)
    if headless_embedding(model, weights, model_dir):
        # Saved without its LM head (sentence-transformers' Qwen3-Embedding-4B/8B): embedding
        # reads the states before it, so the token embedding stands in (tied: no new weights).
        if log is not None:
            log(f"{model_dir}: an embedding checkpoint without an LM head; not needed to embed")
        model = build_model({**config, "tie_word_embeddings": True}, source)
    if (record := quantization_record(config, source)) is not None:
        apply_quantization(model, record, weights)
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    load_weights_into(model, weights, weights_source(model_dir))
    model.eval()
    model.source_dir = model_dir  # what the prefix cache on disk fingerprints (batch/disk.py)
    materialize(model)
    backends.apply(model, log=log)  # the CPU backend's layers and measured plans, on the CPU
    return model, config


def check_fits(
    model_dir: Path, args: Any = None, dtype: mx.Dtype | None = None, kv_budget: int | None = None
) -> None:
    """Refuse a model whose weights (at ``dtype``), KV budget and headroom exceed what the
    machine can give now (memory.py: the GPU's recommended working set on a Mac, available
    RAM elsewhere), naming every number. ``kv_budget`` None: the KV of
    ``memory.LOAD_KV_TOKENS`` tokens (or the whole context if shorter), estimated from
    ``args``."""
    if kv_budget is None and args is not None:
        context = getattr(args, "max_position_embeddings", None)
        tokens = (
            min(context, memory.LOAD_KV_TOKENS)
            if isinstance(context, int) and context > 0
            else memory.LOAD_KV_TOKENS
        )
        kv_budget = tokens * memory.kv_bytes_per_token_estimate(args, dtype)
    parts = {
        "weights": memory.weights_bytes(weight_files(model_dir), dtype),
        "KV budget": kv_budget or 0,
        "headroom": memory.HEADROOM,
    }
    memory.check_fits(str(model_dir), parts, memory.capacity(memory.recommended_working_set()))


def materialize(model: nn.Module) -> None:
    """Evaluate every array the model holds: weights and the private ones (RoPE frequencies, …).

    MLX 0.32 ties an array that is not yet evaluated to the stream, and so the
    thread, that built it: a model left lazy could only generate on the thread
    that loaded it. Evaluated, it can be shared by any thread.
    """
    mx.eval([v for _, v in tree_flatten(model) if isinstance(v, mx.array)])  # a Module is a dict


def load(
    path_or_repo: str | os.PathLike | None = None,
    *,
    dtype: mx.Dtype | None | str = "auto",
    log: Callable[[str], None] | None = None,
    progress: Progress | None = None,
    force: bool = False,
    kv_budget: int | None = None,
):
    """Load a model directory, a ``.gguf`` file (imported once into the cache), a Hub repo id,
    or (``None``) the default model.

    Returns ``(model, tokenizer)``. ``dtype``: "auto" computes in float32 on
    the CPU backend and in the stored dtypes on Metal; None keeps the stored
    dtypes; or an ``mx`` float dtype. ``log`` receives progress messages (the
    library itself never prints). ``progress(stage, done, total)``: the weights read, in
    bytes (:mod:`mlxinfer.platform.progress`). ``force``: load even if the weights, the KV cache
    and headroom exceed what the machine can give (an InsufficientMemoryError naming the
    numbers otherwise: :func:`check_fits`); ``kv_budget``: the KV bytes the caller will give
    the model (a batch engine's ``kv_budget``), None for a single generation's.
    ``mlxinfer.load(path, distributed=...)`` loads one rank's part instead
    (:func:`mlxinfer.distributed.load`).
    """
    from ..tokenization import Tokenizer

    def load_dir(model_dir: Path):
        model, _ = load_model(
            model_dir, dtype=dtype, log=log, progress=progress, force=force, kv_budget=kv_budget
        )
        tokenizer = check_vocabulary(model, Tokenizer.from_dir(model_dir), log=log)
        release_free_heap()  # the tokenizer's parse, freed but held by the C heap
        return model, tokenizer

    return open_model(path_or_repo, load_dir, log=log)


def open_model(
    path_or_repo: str | os.PathLike | None, load_dir: Callable[[Path], Any], *, log=None
):
    """``load_dir(model_dir)`` for the model ``path_or_repo`` names: a directory, a ``.gguf``
    file (imported once into the cache), a Hub repo id, or ``None``: the default model (fetched
    again if damaged). A fast BLAS found too late to load is a warning first (``log``, else
    ``warnings``). :func:`load` loads the whole model in the directory;
    ``mlxinfer.distributed.load`` one rank's part."""
    from ..platform.blas import late_warning

    if warning := late_warning():
        if log is not None:
            log(f"warning: {warning}")
        else:
            warnings.warn(warning, RuntimeWarning, stacklevel=3)
    if path_or_repo is None:  # a damaged default model is fetched again (default_model.py)
        from .default_model import load_default_model

        return load_default_model(load_dir, log=log)
    path = resolve_model_path(path_or_repo)
    if path.is_file():  # a .gguf: imported once into the cache (gguf_files.py)
        from .gguf_files import model_dir_for

        path = model_dir_for(path, log=log)
    return load_dir(path)


def check_vocabulary(model: nn.Module, tokenizer, log: Callable[[str], None] | None = None):
    """The tokenizer's special ids held to the model's embedding rows, at load.

    BOS is fed to the model (the tokenizer adds it, or a chat template writes it): past the
    rows it is a ConfigError. EOS ids are only compared with sampled ones, so one past the rows
    (it can never be sampled) is dropped with a warning: checkpoints whose config names an EOS
    their small test vocabulary lacks still load. The LM head may not have more rows than the
    embedding either: its sampled ids are fed back unchecked. Returns ``tokenizer``.
    """
    rows = embedding_rows(model)
    head = getattr(getattr(model, "head", None), "weight", None)
    if rows is None:
        return tokenizer
    source = f"{tokenizer.path}"
    if head is not None and head.shape[0] > rows:
        raise ConfigError(
            f"{source}: the LM head has {head.shape[0]} rows but the embedding {rows} "
            "(expected at most as many: sampled tokens are fed back)"
        )
    bos = tokenizer.bos_token_id
    if bos is not None and not 0 <= bos < rows:
        raise ConfigError(
            f"{source}: BOS token {tokenizer.bos_token!r} has id {bos}, outside the model's "
            f"{rows}-row embedding (config.json vocab_size; expected 0..{rows - 1})"
        )
    outside = sorted(i for i in tokenizer.eos_token_ids if not 0 <= i < rows)
    if outside:
        message = (
            f"warning: {source}: EOS id(s) {outside} outside the model's {rows}-row embedding "
            "are ignored (the model cannot produce them)"
        )
        if log is not None:
            log(message)
        else:
            warnings.warn(message[len("warning: ") :], RuntimeWarning, stacklevel=3)
        tokenizer.eos_token_ids = frozenset(tokenizer.eos_token_ids) - set(outside)
    return tokenizer
