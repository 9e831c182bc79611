"""Typed, range-checked reads of GGUF metadata.

The container (container.py) gives each value as the file typed it: ``int``, ``float``,
``bool``, ``str``, a numpy array (numeric arrays) or a list (strings, arrays of arrays).
A hostile file can put any of them under any key, so every value that becomes part of
config.json or the tokenizer is read through one of these, and a wrong type or an
out-of-range value is a one-line error naming the key, the expected and the found value
(``error``: ConfigError for the model's shape, TokenizerError for the vocabulary). A key
that is needed and absent is ``missing`` (WeightsError unless said otherwise).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..errors import ConfigError, MlxInferError, WeightsError

REQUIRED = object()  # ``default`` of a key that must be present


def describe(value) -> str:
    """A metadata value as an error message shows it: its type, and short values themselves."""
    if isinstance(value, bool):
        return f"a bool ({value})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a float ({value!r})"
    if isinstance(value, str):
        return f"a string {value[:40]!r}"
    if isinstance(value, np.ndarray):
        return f"an array of {value.size} {value.dtype}"
    if isinstance(value, list):
        return f"an array of {len(value)} values"
    return type(value).__name__


def _lookup(path: Path, md: dict, key: str, default, missing: type[MlxInferError]):
    if key in md:
        return md[key]
    if default is REQUIRED:
        raise missing(f"{path}: GGUF metadata lacks {key}")
    return default


def integer(path: Path, md: dict, key: str, *, lo: int = 1, hi: int, default=REQUIRED,
            error=ConfigError, missing=WeightsError) -> int:  # fmt: skip
    """An integer in [lo, hi] (a bool or float is not one)."""
    value = _lookup(path, md, key, default, missing)
    if key not in md:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{path}: {key}: expected an integer in [{lo}, {hi}], found {describe(value)}")
    if not lo <= value <= hi:
        raise error(f"{path}: {key}: expected an integer in [{lo}, {hi}], found {value}")
    return value


def number(path: Path, md: dict, key: str, *, hi: float, default=REQUIRED, error=ConfigError,
           missing=WeightsError) -> float:  # fmt: skip
    """A finite number in (0, hi] (every float the config takes is a positive size or rate)."""
    value = _lookup(path, md, key, default, missing)
    if key not in md:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{path}: {key}: expected a number in (0, {hi:g}], found {describe(value)}")
    if not (math.isfinite(value) and 0 < value <= hi):
        raise error(f"{path}: {key}: expected a number in (0, {hi:g}], found {value!r}")
    return float(value)


def boolean(path: Path, md: dict, key: str, *, default, error=ConfigError) -> bool:
    """A bool (llama.cpp writes flags as GGUF bools; 0 and 1 are taken too)."""
    value = md.get(key, default)
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise error(f"{path}: {key}: expected a bool, found {describe(value)}")


def string(path: Path, md: dict, key: str, *, default=REQUIRED, error=ConfigError,
           missing=WeightsError) -> str | None:  # fmt: skip
    value = _lookup(path, md, key, default, missing)
    if key in md and not isinstance(value, str):
        raise error(f"{path}: {key}: expected a string, found {describe(value)}")
    return value


def strings(path: Path, md: dict, key: str, *, default=REQUIRED, error=ConfigError,
            missing=WeightsError) -> list[str]:  # fmt: skip
    """An array of strings."""
    value = _lookup(path, md, key, default, missing)
    if key in md and not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise error(f"{path}: {key}: expected an array of strings, found {describe(value)}")
    return value


def numbers(path: Path, md: dict, key: str, n: int, *, integers: bool, default=REQUIRED,
            error=ConfigError, missing=WeightsError) -> np.ndarray:  # fmt: skip
    """A numeric array of ``n`` values (integers only, if ``integers``)."""
    value = _lookup(path, md, key, default, missing)
    if key not in md:
        return value
    kinds = "iu" if integers else "iuf"
    what = "integers" if integers else "numbers"
    if not (isinstance(value, np.ndarray) and value.dtype.kind in kinds):
        raise error(f"{path}: {key}: expected an array of {n} {what}, found {describe(value)}")
    if value.size != n:
        raise error(f"{path}: {key}: expected an array of {n} {what}, found {value.size}")
    return value
