"""A checkpoint's Hugging Face tokenizer side files, read and checked as transformers reads them.

tokenizer_config.json (special tokens, ``added_tokens_decoder``, ``add_bos_token`` /
``add_eos_token``), special_tokens_map.json and added_tokens.json for older checkpoints, and
the ``eos_token_id`` fields of generation_config.json and config.json. A file that is not a
JSON object, or a key of the wrong type, is a one-line TokenizerError naming the file and key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import TokenizerError

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def read_json(file: Path) -> dict[str, Any]:
    """A JSON object from ``file``, or {} when the file does not exist."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{file}: cannot read as JSON ({' '.join(str(exc).split())})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return data


def named_special_tokens(path: Path, config: dict[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as strings.

    transformers' rule: when tokenizer_config.json has no ``added_tokens_decoder``
    (older checkpoints), special_tokens_map.json overrides its values.
    """
    sources = [(path / "tokenizer_config.json", config)]
    if "added_tokens_decoder" not in config:
        sources.append(
            (path / "special_tokens_map.json", read_json(path / "special_tokens_map.json"))
        )
    tokens = {}
    for file, data in sources:
        for key in _NAMED_TOKENS:
            if data.get(key) is not None:
                tokens[key] = _token_content(data[key], file, key)
    return tokens


def added_tokens(
    path: Path, config: dict[str, Any], special_tokens: dict[str, str]
) -> dict[int, tuple[str, bool]]:
    """id -> (content, special) from tokenizer_config.json's added_tokens_decoder, or legacy added_tokens.json."""
    added = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        content = _token_content(
            entry, path / "tokenizer_config.json", f"added_tokens_decoder.{key}"
        )
        if content is None or not str(key).isdigit():
            raise TokenizerError(
                f"{path / 'tokenizer_config.json'}: 'added_tokens_decoder' should map integer ids to tokens, "
                f"found {key!r}"
            )
        added[int(key)] = (content, not (isinstance(entry, dict) and entry.get("special") is False))
    if not added:
        for content, token_id in read_json(path / "added_tokens.json").items():
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise TokenizerError(
                    f"{path / 'added_tokens.json'}: {content!r} should map to an integer id, found {token_id!r}"
                )
            added[token_id] = (content, content in special_tokens.values())
    return added


def config_flag(path: Path, config: dict[str, Any], key: str) -> bool:
    value = config.get(key, False)  # transformers 5 defaults both to False
    if not isinstance(value, bool):
        raise TokenizerError(
            f"{path / 'tokenizer_config.json'}: '{key}' should be true or false, found {value!r}"
        )
    return value


def _token_content(value: Any, file: Path, key: str) -> str | None:
    """A special token given as a string or as a serialized AddedToken ``{"content": ...}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(
        f"{file}: '{key}' should be a string or an object with 'content', found {value!r}"
    )


def id_list(value: Any, file: Path, key: str) -> list[int]:
    """An id field that may be absent, an int, or a list of ints."""
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise TokenizerError(f"{file}: '{key}' should be an int or a list of ints, found {value!r}")
