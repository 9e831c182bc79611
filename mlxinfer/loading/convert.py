"""Hugging Face checkpoint (or GGUF file) → mlxinfer model directory.

``read → sanitize → (quantize) → write``. The output is written into a
temporary directory beside the destination, flushed to disk and renamed only
when complete (:mod:`mlxinfer.files.atomic`), so a failed or killed conversion leaves
nothing behind; the last file written is the manifest of every file's size and
SHA-256 (:mod:`mlxinfer.files.manifest`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import ConfigError
from ..files.atomic import scratch_dir, writing_dir
from ..files.manifest import existing_output_error, write_manifest
from ..models import build_model, get_family
from ..models.base import language_model_weights
from ..models.config import read_config
from ..platform.progress import Progress, finished, resolve
from ..quant.transform import (
    apply_quantization,
    bits_per_weight,
    quantization_record,
    quantize_model,
)
from .loader import IMATRIX_NAME, SIDE_FILES, load_weights_into, read_weights, resolve_model_path
from .shards import ShardWriter

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tiktoken.model",
    "processor_config.json",  # an image-text checkpoint's processor (transformers 5)
    "preprocessor_config.json",  # ... and before
)
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


DEFAULT_BPW = 4.5  # -q alone: the measured plan at this size (SmolLM2: see docs/quality.md)
# -q alone on an encoder (BERT), which has no LM head for a plan to measure: uniform 8-bit. On
# all-MiniLM-L6-v2, cosine to the float32 vectors of six sentences: 4-bit group 64 0.93-0.97,
# 6-bit 0.996-0.998, 8-bit 0.9997-0.9999 (tests/real/test_bert_minilm.py checks the 8-bit).
ENCODER_BITS = 8
# A sentence-transformers checkpoint's own files (mlxinfer/embeddings reads them), kept as they are.
EMBEDDING_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
EMBEDDING_MODULES = ("1_Pooling", "2_Normalize")  # the module folders' config.json


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    quantize: bool = False,
    bits: int | None = None,
    group_size: int | None = None,
    rounding: str | None = None,
    bpw: float | None = None,
    max_bytes: int | None = None,
    recipe: str | None = None,
    tensor_bits: Sequence[str] = (),
    calibration: str | os.PathLike | None = None,
    imatrix: str | os.PathLike | None = None,
    plan_from: str | os.PathLike | None = None,
    dtype: str | None = None,
    progress: bool | Progress = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Convert ``src`` (HF directory, Hub repo id or ``.gguf`` file) into ``dst``.

    Args:
        quantize: quantize Linear/Embedding weights. Alone: the measured plan at
            :data:`DEFAULT_BPW` bits per weight (as ``bpw=4.5``). With ``bits`` or ``group_size``:
            every layer uniform at those settings (4 bits, group 64 for the one not given).
        bpw, max_bytes: a mixed plan within this size (bits per parameter of the weight files,
            or their bytes): each tensor's bits and group size chosen from measured costs on
            calibration tokens (:mod:`mlxinfer.quant.plan`). Implies ``quantize``.
        recipe: a named mixed recipe (``q4_k_m``, ``q3_k_m``) instead of a budget.
        tensor_bits: ``PATTERN=BITS[:GROUP]`` forced on matching tensors of a plan.
        calibration: a UTF-8 text file to calibrate on; default: the calibration text shipped
            with the package (never the evaluation text).
        imatrix: an importance file (ours or llama.cpp's) instead of the calibration pass.
        plan_from: a previous conversion's ``quantization-plan.json`` of the same model: its
            measured costs plan this budget without measuring each tensor again.
        rounding: ``"minmax"`` (each group's scale and bias from its min and max, as
            ``mx.quantize``), ``"mse"`` (fitted to the least squared error, weighted by
            activation importance in a plan; same format) or ``"gptq"`` (a plan only: the
            columns rounded in order, each one's error compensated in the later ones through
            the layer's input covariance from the calibration pass, :mod:`mlxinfer.quant.gptq`;
            same format). Default: ``mse`` for a plan, ``minmax`` for a uniform conversion.
        dtype: float16, bfloat16 or float32 for the float weights; default: the
            checkpoint's own dtype (``torch_dtype`` / ``dtype``), else float16.
        progress: True: progress bars on stderr; a callback: ``(stage, done, total)`` for
            reading and writing the weights (bytes) or importing a GGUF's tensors
            (:mod:`mlxinfer.platform.progress`).
    Returns:
        A report: parameters, bits per weight, bytes on disk, output path, and for a plan its
        settings, predicted and measured KL divergence on the probe tokens.
    """
    dst = Path(dst).expanduser()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConfigError(existing_output_error(dst))
    planned = bpw is not None or max_bytes is not None or recipe is not None
    bare_q = False  # -q alone: a plan for a decoder, uniform for an encoder (below)
    uniform = bits is not None or group_size is not None
    if planned and uniform:
        raise ConfigError(
            "--bits/--group-size mean one uniform setting; a plan (--bpw, --max-bytes, --recipe) "
            "chooses them per tensor: give one or the other"
        )
    if sum(x is not None for x in (bpw, max_bytes, recipe)) > 1:
        raise ConfigError("give one of --bpw, --max-bytes or --recipe")
    if bpw is not None and not 1.0 < bpw < 16.0:
        raise ConfigError(f"--bpw: expected bits per weight in 1..16, found {bpw}")
    gguf = str(src).endswith(".gguf")
    if quantize and not uniform and not planned and not (gguf and dtype is None):
        # -q alone: the measured plan. A GGUF without --dtype keeps its own grids instead (below).
        bpw, planned, bare_q = DEFAULT_BPW, True, True
    extras = tensor_bits or calibration is not None or imatrix is not None or plan_from is not None
    if extras and not planned:
        raise ConfigError(
            "--tensor-bits, --calibration, --imatrix and --plan-from apply to a mixed plan (-q, --bpw, "
            "--max-bytes or --recipe; a GGUF source with --dtype)"
        )
    if rounding == "gptq" and not planned:
        raise ConfigError(
            "--rounding gptq needs a calibration pass, which only a plan runs: use it with -q, "
            "--bpw, --max-bytes or --recipe"
            + (" and --dtype (a GGUF without --dtype keeps its own grids)" if gguf else "")
            + ", or --rounding mse"
        )
    settings: dict[str, Any] | None = None
    if uniform:
        settings = dict(bits=bits or 4, group_size=group_size or 64, rounding=rounding or "minmax")
    elif planned:
        settings = dict(
            bpw=bpw,
            max_bytes=max_bytes,
            recipe=recipe,
            tensor_bits=tuple(tensor_bits),
            calibration=calibration,
            imatrix=imatrix,
            plan_from=plan_from,
            rounding=rounding or "mse",
        )
    if gguf:
        from ..gguf import import_gguf

        if planned:  # every tensor quantized afresh from the dequantized weights
            with scratch_dir(dst.parent, dst.name + ".float") as work:
                import_gguf(Path(src), work / "f", dtype=dtype or "float32", log=log)
                return convert(
                    work / "f", dst, **_plan_args(settings), dtype=dtype, progress=progress, log=log
                )
        if rounding not in (None, "minmax"):
            raise ConfigError(
                f"--rounding {rounding} is not supported for a GGUF source yet; convert it with "
                "--dtype float32 first, then quantize that directory"
            )
        # Without --dtype the file's own types are kept, and -q re-quantizes only its K-quant tensors;
        # with --dtype every tensor is dequantized to it, and -q quantizes as for a HF checkpoint.
        requantize = None
        if quantize:
            requantize = (bits or 4, group_size or 64)
        return import_gguf(
            Path(src),
            dst,
            requantize=requantize,
            dtype=dtype,
            progress=progress,
            log=log,
        )
    src_dir = resolve_model_path(src)
    config = read_config(src_dir)
    source = src_dir / "config.json"
    family = get_family(config, str(source))
    if settings is not None and "bits" not in settings and getattr(family.Model, "encoder_only", 0):
        if not (bare_q and not extras):
            raise ConfigError(
                f"{source}: a mixed plan measures each tensor on the LM head's output, and "
                f"model_type '{config.get('model_type')}' is an encoder without one: "
                f"use -q alone ({ENCODER_BITS}-bit) or --bits"
            )
        settings = dict(bits=ENCODER_BITS, group_size=64, rounding=rounding or "minmax")
    model = build_model(config, str(source))
    target = _target_dtype(config, dtype, source)
    from ..tokenization import Tokenizer

    tokenizer = Tokenizer.from_dir(src_dir)  # a missing or broken tokenizer fails before any work
    report = resolve(progress)
    try:
        return _convert_hf(
            src_dir, dst, config, family, model, target, settings, report, tokenizer, log
        )
    finally:
        finished(report)


def _plan_args(settings: dict[str, Any]) -> dict[str, Any]:
    out = dict(settings)
    out["quantize"] = True
    return out


def _sanitized(src_dir, config, family, args, report=None) -> dict[str, mx.array]:
    """The checkpoint's weights as the model names them: lazy loads (``mx.load`` reads a
    tensor when it is first evaluated) and lazy fix-ups."""
    weights = read_weights(src_dir, report)
    if config.get("language_model_of"):
        weights = language_model_weights(weights)
    return family.Model.sanitize(weights, args)


def _cast(weights: dict[str, mx.array], target: mx.Dtype) -> dict[str, mx.array]:
    return {
        k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }


def _convert_hf(src_dir, dst, config, family, model, target, settings, report, tokenizer, log):
    weights = _sanitized(src_dir, config, family, model.args, report)
    if (stored := quantization_record(config)) is not None:  # e.g. MXFP4 experts, kept as they are
        apply_quantization(model, stored, weights)
    load_weights_into(model, _cast(weights, target), src_dir)  # still lazy: nothing read yet
    del weights
    drop = ("quantization_config", "language_model_of")
    out_config = {k: v for k, v in config.items() if k not in drop}
    out_config["torch_dtype"] = _dtype_name(target)
    if "dtype" in out_config:  # transformers 5's name for the same field
        out_config["dtype"] = _dtype_name(target)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    plan = None
    if settings is not None and "bits" in settings:  # uniform: bits, group_size, rounding
        out_config["quantization"] = quantize_model(model, **settings)
    elif settings is not None:
        # Planned layer by layer: each pass puts fresh lazy loads back in place of a block's
        # weights once it is through it, so about one block is resident at a time.
        def fresh() -> dict[str, mx.array]:
            return _cast(_sanitized(src_dir, config, family, model.args), target)

        plan = _plan(model, tokenizer, settings, src_dir, config, log, report, fresh)
    elif stored is not None:
        out_config["quantization"] = stored

    with writing_dir(dst) as tmp:
        shards = ShardWriter(tmp, model, report)
        if plan is not None:  # each layer written once it is quantized, then dropped
            try:
                out_config["quantization"] = quantize_model(
                    model,
                    rounding=settings["rounding"],
                    layers=plan.layers(),
                    importance=plan.mean,
                    covariance=plan.covariance,
                    # 16-bit scales and biases: what the plan's sizes assume (f32 ones would
                    # add a bit per weight at group 64 for no measurable gain).
                    scale_dtype=mx.float16 if target == mx.float32 else target,
                    done=shards.layer,
                )
            finally:
                plan.drop_covariances()
        shards.finish()
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2, default=str))
        for name in TOKENIZER_FILES + tuple(p.name for p in src_dir.glob("*.tiktoken")):
            if (src_dir / name).is_file():
                shutil.copy2(src_dir / name, tmp / name)
        for name in EMBEDDING_FILES + tuple(f"{d}/config.json" for d in EMBEDDING_MODULES):
            if (src_dir / "modules.json").is_file() and (src_dir / name).is_file():
                (tmp / name).parent.mkdir(exist_ok=True)
                shutil.copy2(src_dir / name, tmp / name)
        if plan is not None:
            (tmp / PLAN_NAME).write_text(json.dumps(plan.record(), indent=1))
            if plan.counts:
                _save_importance(tmp / IMATRIX_NAME, plan, src_dir)
        write_manifest(tmp)  # last: it lists every file above
    n_bytes = sum(f.stat().st_size for f in dst.glob("*.safetensors") if f.name not in SIDE_FILES)
    out = {
        "path": str(dst),
        "parameters": n_params,
        "bits_per_weight": bits_per_weight(model),
        "bytes": n_bytes,
    }
    if plan is not None:
        out.update(
            plan=plan.summary(),
            predicted_kl=plan.predicted_kl,
            measured_kl=plan.measured_kl,
            calibration_tokens=plan.tokens,
            plan_seconds=plan.seconds,
        )
    return out


def _plan(model, tokenizer, settings, src_dir, config, log, report, fresh):
    from ..quant.mixed import plan_model

    importance = None
    if settings["imatrix"] is not None:
        from .imatrix import load_importance

        imp = load_importance(settings["imatrix"], config=config)
        importance = (imp.sums, imp.counts)
    costs = None
    if settings["plan_from"] is not None:
        costs = _read_costs(Path(settings["plan_from"]).expanduser())
    docs = _calibration_documents(tokenizer, settings["calibration"])
    token_lists = [tokenizer.encode(d) for d in docs]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("a")[:1] == [bos]
    max_bytes = settings["max_bytes"]
    return plan_model(
        model,
        token_lists,
        vocab=tokenizer.vocab_size,
        bos=bos if adds_bos else None,
        bpw=settings["bpw"],
        max_bytes=max_bytes,
        recipe=settings["recipe"],
        overrides=settings["tensor_bits"],
        importance=importance,
        costs=costs,
        covariance=settings["rounding"] == "gptq",
        weights=fresh,
        log=log,
        progress=report,
    )


PLAN_NAME = "quantization-plan.json"  # a plan's settings, figures and measured costs


def _read_costs(path: Path) -> dict:
    try:
        costs = json.loads(path.read_text(encoding="utf-8"))["costs"]
    except OSError as e:
        raise ConfigError(f"--plan-from {path}: cannot read it ({e.strerror})") from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"--plan-from {path}: expected a {PLAN_NAME} with 'costs', found another file"
        ) from None
    if not isinstance(costs, dict):
        raise ConfigError(f"--plan-from {path}: expected 'costs' to be an object")
    return costs


def _calibration_documents(tokenizer, calibration) -> list[str]:
    if calibration is not None:
        path = Path(calibration).expanduser()
        try:
            return [path.read_text(encoding="utf-8")]
        except OSError as e:
            raise ConfigError(f"--calibration {path}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"--calibration {path}: expected UTF-8 text, found byte {e.object[e.start]:#04x} "
                f"at offset {e.start}"
            ) from None
    from ..quant.corpus import calibration_documents

    return calibration_documents(tokenizer)


def _save_importance(path: Path, plan, src_dir: Path) -> None:
    from .imatrix import Importance, save_importance

    imp = Importance(
        sums=plan.sums, counts=plan.counts, meta={"model": src_dir.name, "tokens": str(plan.tokens)}
    )
    save_importance(imp, path)


def _target_dtype(config: dict, dtype: str | None, source: Path) -> mx.Dtype:
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConfigError(f"--dtype: expected one of {', '.join(DTYPES)}, found '{dtype}'")
        return DTYPES[dtype]
    name = config.get("torch_dtype") or config.get("dtype") or "float16"
    return DTYPES.get(str(name).replace("torch.", ""), mx.float16)


def _dtype_name(dtype: mx.Dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)
