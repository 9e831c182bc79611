"""The prompts of ``mlxinfer generate --batch FILE``: one per line, or JSON Lines.

A line that starts with ``{`` is a JSON object with ``"prompt"`` (text) or
``"messages"`` (chat messages); any other non-blank line is a prompt's text.
Blank lines are skipped. A bad line is an error naming the file and the line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import MlxInferError


class PromptFileError(MlxInferError):
    pass


def read_prompts(path: str | Path) -> list[str | list[dict[str, Any]]]:
    """The prompts in ``path``: texts, or message lists from JSON lines."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{path}: cannot read the prompts ({e})") from None
    prompts: list[str | list[dict[str, Any]]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line)
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(
                f"{where}: not valid JSON ({e.msg} at column {e.colno})"
            ) from None
        if isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        elif isinstance(item.get("messages"), list) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in item["messages"]
        ):
            prompts.append(item["messages"])
        else:
            raise PromptFileError(
                f'{where}: expected a "prompt" string or a "messages" list of '
                f'{{"role", "content"}} objects, found keys {sorted(item)}'
            )
    if not prompts:
        raise PromptFileError(f"{path}: no prompts (one per line, or JSON lines)")
    return prompts
