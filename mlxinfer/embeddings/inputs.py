"""What may be embedded: texts or token-id rows, checked and tokenized as the checkpoint says
(lower-cased, cut to ``max_seq_length`` with the special tokens kept)."""

from __future__ import annotations

from typing import Any

from ..errors import MlxInferError, PromptTooLongError
from ..generation.prefill import check_token_ids, token_ids
from .checkpoint import Pooling

# A text cut to ``max_length`` tokens may be longer than the context in characters; past this
# it is refused all the same (tokenizing it would cost more than embedding what is kept).
MAX_TRUNCATED_CHARS = 1 << 20


class EmbeddingError(MlxInferError, ValueError):
    """An input that cannot be embedded: an empty one, a wrong type, a bad ``dimensions``."""


def check_dimensions(dimensions: Any, width: int) -> None:
    if dimensions is None:
        return
    if (
        not isinstance(dimensions, int)
        or isinstance(dimensions, bool)
        or not 0 < dimensions <= width
    ):
        raise EmbeddingError(
            f"dimensions: expected an int in 1..{width} (the model's width), found {dimensions!r:.40}"
        )


def truncate(tokenizer, text: str, row: list[int], max_length: int) -> list[int]:
    """``row`` (``text`` tokenized with its special tokens) cut to ``max_length`` tokens as
    transformers' tokenizers truncate: the text's tokens are cut, the special tokens the
    post-processor adds around them ([CLS] ... [SEP]; Qwen3-Embedding's closing EOS) kept."""
    if len(row) <= max_length:
        return row
    plain = tokenizer.encode(text, add_special_tokens=False)
    added = len(row) - len(plain)
    start = next((p for p in range(added + 1) if row[p : p + len(plain)] == plain), None)
    if added < 0 or start is None:  # not the text between special tokens: cut the row itself
        return row[:max_length]
    return row[:start] + plain[: max(max_length - added, 0)] + row[start + len(plain) :]


def encode_inputs(
    model,
    tokenizer,
    inputs: Any,
    *,
    max_inputs: int | None = None,
    pooling: Pooling | None = None,
) -> list[list[int]]:
    """``inputs`` (a string, a list of strings, or a list of token-id lists) as token-id rows,
    each checked: not empty, every id in the vocabulary, within the model's context. Texts are
    lower-cased and cut to ``pooling.max_length`` tokens where the checkpoint says so; token-id
    rows are used as given."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs:
        raise EmbeddingError(
            "input: expected a string, a non-empty list of strings or of token-id lists, "
            f"found {_kind(inputs)}"
        )
    if max_inputs is not None and len(inputs) > max_inputs:
        raise EmbeddingError(f"input: {len(inputs)} items, at most {max_inputs} per request")
    texts = isinstance(inputs[0], str)
    context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    max_length = pooling.max_length if pooling is not None else None
    max_chars = MAX_TRUNCATED_CHARS if max_length is not None else None
    if max_chars is None and isinstance(context, int):
        max_chars = 16 * context
    rows = []
    for i, item in enumerate(inputs):
        what = f"input[{i}]"
        if texts and isinstance(item, str):
            if max_chars is not None and len(item) > max_chars:
                raise PromptTooLongError(
                    f"{what}: {len(item)} characters, past the model's context of {context} tokens"
                    if max_length is None
                    else f"{what}: {len(item)} characters, at most {max_chars}"
                )
            if pooling is not None and pooling.lowercase:
                item = item.lower()
            row = tokenizer.encode(item, add_special_tokens=True)
            if max_length is not None:
                row = truncate(tokenizer, item, row, max_length)
        elif not texts and isinstance(item, list):
            row = token_ids(item, what)
            check_token_ids(model, row, what)
        else:
            first = "strings" if texts else "token-id lists"
            raise EmbeddingError(f"{what}: expected {first} like input[0], found {_kind(item)}")
        if not row:
            raise EmbeddingError(f"{what}: empty; nothing to embed")
        if isinstance(context, int) and len(row) > context:
            raise PromptTooLongError(
                f"{what}: {len(row)} tokens, more than the model's context of {context}"
            )
        rows.append(row)
    return rows


def _kind(value: Any) -> str:
    return "an empty list" if value == [] else type(value).__name__
