"""Prompt text cleaning and fitting a prompt into the model's context."""

from __future__ import annotations

import unicodedata

from ..errors import PromptTooLongError


def clean_prompt(text: str) -> str:
    """Normalise newlines (CRLF/CR → LF) and drop control characters but tab and newline."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "".join(ch for ch in text if ch in "\t\n" or unicodedata.category(ch) != "Cc")


def fit_context(ids: list[int], context: int, max_tokens: int, *, truncate: bool) -> list[int]:
    """Return ``ids`` if they leave room to generate; else left-truncate or refuse.

    Left-truncation keeps the most recent tokens and leaves room for
    ``min(max_tokens, context // 2)`` new ones.
    """
    if len(ids) < context:
        return ids
    if not truncate:
        raise PromptTooLongError(
            f"prompt: {len(ids)} tokens, but the model's context is {context} tokens "
            "(max_position_embeddings); shorten it or left-truncate (--truncate-prompt)"
        )
    keep = context - max(1, min(max_tokens, context // 2))
    return ids[-keep:]
