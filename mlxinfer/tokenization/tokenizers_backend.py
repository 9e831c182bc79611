"""The tokenizer.json backend: the Hugging Face `tokenizers` library, run as serialized."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import TokenizerError


class TokenizersBackend:
    """tokenizer.json, run by the `tokenizers` library exactly as serialized."""

    def __init__(self, file: Path) -> None:
        import tokenizers

        self.file = file
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise TokenizerError(f"{file}: cannot load ({' '.join(str(exc).split())})") from exc
        # A truncation/padding block saved in tokenizer.json would silently cut prompts.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        added = self._tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        self.byte_fallback_ids: frozenset[int] = frozenset()
        decoder = self._tokenizer.decoder
        if decoder is not None and _has_byte_fallback(json.loads(decoder.__getstate__())):
            ids = (self._tokenizer.token_to_id(f"<0x{byte:02X}>") for byte in range(256))
            self.byte_fallback_ids = frozenset(i for i in ids if i is not None)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= 2**32):
            # tokenizers skips unknown ids but cannot take ones outside its u32
            ids = [i for i in ids if 0 <= i < 2**32]
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def to_str(self) -> str:
        return self._tokenizer.to_str()

    def token_bytes(self) -> list[bytes]:
        raise NotImplementedError("tokenizer.json: its token table is read from to_str()")


def _has_byte_fallback(decoder: Any) -> bool:
    """Whether a serialized `tokenizers` decoder (possibly a Sequence) contains ByteFallback."""
    if isinstance(decoder, dict):
        return decoder.get("type") == "ByteFallback" or any(
            map(_has_byte_fallback, decoder.values())
        )
    if isinstance(decoder, list):
        return any(map(_has_byte_fallback, decoder))
    return False
