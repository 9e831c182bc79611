"""What a sentence-transformers checkpoint says about turning token states into one vector.

    modules.json                [Transformer, Pooling (path "1_Pooling"), Normalize?]
    1_Pooling/config.json       {"pooling_mode_mean_tokens": true, ...}
    sentence_bert_config.json   {"max_seq_length": 256, "do_lower_case": false}   (optional)

``Normalize`` is a module without files: modules.json may name a ``2_Normalize`` folder that
is not there. Anything else these files hold is a ConfigError naming the file and the key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

MODULES = "modules.json"
SENTENCE_BERT_CONFIG = "sentence_bert_config.json"
MAX_CONFIG_BYTES = 1 << 16  # each of these files is a few hundred bytes in practice
MAX_MODULES = 16
MODES = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean"}
MODES["pooling_mode_cls_token"] = "cls"
UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_MODULE_TYPE = "sentence_transformers.models."
_KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}
_SUBDIR = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class Pooling:
    """How a text becomes one vector: ``mode`` "lasttoken" (the last token's state), "mean"
    (the mean over its tokens) or "cls" (the first token's); ``normalize``: to unit L2 norm;
    ``dimension``: the width the checkpoint declares (checked against the model);
    ``max_length``: a text's tokens past it are cut off, its special tokens kept
    (sentence-transformers' ``max_seq_length``; None: the model's context bounds them);
    ``lowercase``: the text is lower-cased before tokenizing (``do_lower_case``)."""

    mode: str = "lasttoken"
    normalize: bool = True
    dimension: int | None = None
    max_length: int | None = None
    lowercase: bool = False


def is_embedding_dir(path: str | Path) -> bool:
    """Whether ``path`` is a sentence-transformers checkpoint (has a modules.json)."""
    return (Path(path) / MODULES).is_file()


def _read_json(file: Path) -> Any:
    try:
        with open(file, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{file}: cannot read ({e.strerror or e})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{file}: larger than {MAX_CONFIG_BYTES} bytes; not a pooling config")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{file}: not valid JSON ({' '.join(str(e).split())[:120]})") from None


def read_pooling(path: str | Path) -> Pooling:
    """The pooling a sentence-transformers checkpoint declares (modules.json, its Pooling
    module's config.json, and sentence_bert_config.json where there is one); a ConfigError
    naming the file and key for anything else."""
    path = Path(path)
    file = path / MODULES
    if not file.is_file():
        raise ConfigError(
            f"{file}: missing; not a sentence-transformers embedding checkpoint "
            "(modules.json and 1_Pooling/config.json)"
        )
    modules = _read_json(file)
    if not isinstance(modules, list) or not 0 < len(modules) <= MAX_MODULES:
        raise ConfigError(
            f"{file}: expected a list of 1..{MAX_MODULES} modules, found {modules!r:.80}"
        )
    kinds: dict[str, str] = {}  # module kind -> its path
    for i, module in enumerate(modules):
        kind = module.get("type") if isinstance(module, dict) else None
        where = module.get("path", "") if isinstance(module, dict) else None
        if not isinstance(kind, str) or not isinstance(where, str):
            raise ConfigError(
                f"{file}: module {i} should be an object with string 'type' and 'path', "
                f"found {module!r:.80}"
            )
        short = kind.removeprefix(_MODULE_TYPE)
        if short not in _KNOWN_MODULES or short in kinds:
            raise ConfigError(
                f"{file}: module {i} has type {kind!r:.80}; supported: one each of "
                + ", ".join(_MODULE_TYPE + k for k in sorted(_KNOWN_MODULES))
            )
        kinds[short] = where
    if "Pooling" not in kinds:
        raise ConfigError(f"{file}: no {_MODULE_TYPE}Pooling module")
    subdir = kinds["Pooling"]
    if not _SUBDIR.fullmatch(subdir) or subdir.strip(".") == "":
        raise ConfigError(
            f"{file}: the Pooling module's 'path' should name a subdirectory, found {subdir!r:.80}"
        )
    mode, dimension = _pooling(path / subdir / "config.json")
    max_length, lowercase = _sentence_bert(path / SENTENCE_BERT_CONFIG)
    return Pooling(mode, "Normalize" in kinds, dimension, max_length, lowercase)


def _pooling(file: Path) -> tuple[str, int | None]:
    config = _read_json(file)
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: expected a JSON object, found {type(config).__name__}")
    for key in (*MODES, *UNSUPPORTED_MODES, "include_prompt"):
        if key in config and not isinstance(config[key], bool):
            raise ConfigError(f"{file}: '{key}' should be true or false, found {config[key]!r:.40}")
    for key in UNSUPPORTED_MODES:
        if config.get(key):
            raise ConfigError(f"{file}: '{key}' is not supported (lasttoken, mean or cls pooling)")
    chosen = [mode for key, mode in MODES.items() if config.get(key)]
    if len(chosen) != 1:
        raise ConfigError(
            f"{file}: expected exactly one of {', '.join(MODES)} true, found {len(chosen)}"
        )
    return chosen[0], _positive_int(config, "word_embedding_dimension", file)


def _sentence_bert(file: Path) -> tuple[int | None, bool]:
    """(max_seq_length, do_lower_case) of sentence_bert_config.json; (None, False) without it."""
    if not file.is_file():
        return None, False
    config = _read_json(file)
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: expected a JSON object, found {type(config).__name__}")
    lowercase = config.get("do_lower_case", False)
    if not isinstance(lowercase, bool):
        raise ConfigError(
            f"{file}: 'do_lower_case' should be true or false, found {lowercase!r:.40}"
        )
    return _positive_int(config, "max_seq_length", file), lowercase


def _positive_int(config: dict, key: str, file: Path) -> int | None:
    value = config.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ConfigError(f"{file}: '{key}' should be a positive int, found {value!r:.40}")
    return value
