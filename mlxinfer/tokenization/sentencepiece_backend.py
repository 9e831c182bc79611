"""A checkpoint with only tokenizer.model: SentencePiece, as transformers presents it.

SentencePiece encodes plain text; transformers adds three things on top, and this
backend copies them so both agree on ids and text:

* Special tokens written in the text ("<s>", "[INST]" when it is an added token)
  become their single id. SentencePiece never recognizes them, so the text is cut
  at each one and every piece in between is encoded on its own (each gets the
  model's dummy-prefix "▁", like transformers' converted tokenizer).
* BOS / EOS are added when tokenizer_config.json says ``add_bos_token`` /
  ``add_eos_token``.
* Decoding is transformers' SentencePiece decoder, not ``sp.decode``: special
  tokens are written out unless skipped, "▁" becomes " ", runs of byte pieces
  (``<0xE4>``) are fused into UTF-8 (an invalid run gives one U+FFFD per byte
  piece), and one leading space -- the dummy prefix -- is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import TokenizerError

MAX_ADDED_ID = 2**24  # Tokenizer's bound on the vocabulary


class SentencePieceBackend:
    """Encode / decode with a SentencePiece model plus the checkpoint's added tokens.

    Args:
        file: the tokenizer.model.
        added_tokens: id -> (content, special) from the side files; ids may lie
            beyond the model's pieces.
        special_tokens: the named special tokens (``bos_token``, ...) from the config.
        add_bos / add_eos: whether ``encode(..., add_special_tokens=True)`` adds them.
    """

    def __init__(
        self,
        file: Path,
        *,
        added_tokens: Mapping[int, tuple[str, bool]],
        special_tokens: Mapping[str, str],
        add_bos: bool,
        add_eos: bool,
    ) -> None:
        import sentencepiece

        self.file = file
        try:
            self._sp = sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
        except (OSError, RuntimeError) as exc:
            raise TokenizerError(f"{file}: cannot load ({' '.join(str(exc).split())})") from exc

        # Decoding table: a byte piece "<0xE4>" is stored as its int, any other piece as its text.
        self._pieces: list[str | int] = []
        self._vocab: dict[str, int] = {}
        self._splits: dict[str, int] = {}  # text cut out of the input before SentencePiece sees it
        byte_ids, special_ids = [], set()
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            self._vocab[piece] = i
            if sp.is_byte(i):
                self._pieces.append(int(piece[3:5], 16))
                byte_ids.append(i)
            else:
                self._pieces.append(piece.replace("▁", " "))
            if sp.is_control(i) or sp.is_unknown(i):
                self._splits[piece] = i
                special_ids.add(i)
        self._added: dict[int, str] = {}
        for token_id, (content, special) in sorted(added_tokens.items()):
            if not 0 <= token_id < MAX_ADDED_ID:  # the table below grows to the largest id
                raise TokenizerError(
                    f"{file.parent / 'tokenizer_config.json'}: added token {content!r:.40} has id "
                    f"{token_id}, expected 0..{MAX_ADDED_ID - 1}"
                )
            if token_id >= len(self._pieces):
                self._pieces.extend([""] * (token_id + 1 - len(self._pieces)))
            self._pieces[token_id] = content
            self._added[token_id] = content
            self._vocab[content] = self._splits[content] = token_id
            if special:
                special_ids.add(token_id)
        for content in special_tokens.values():
            if content in self._vocab:
                self._splits[content] = self._vocab[content]
                special_ids.add(self._vocab[content])

        self.vocab_size = len(self._pieces)
        self.special_ids = frozenset(special_ids)
        self.byte_fallback_ids = frozenset(byte_ids)
        self.bos_piece = sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None
        self.eos_piece = sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None
        # Longest first, so that "<|im_end|>" is never cut short by a token that is its prefix.
        ordered = sorted(self._splits, key=len, reverse=True)
        self._split_re = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        bos = self._vocab.get(special_tokens.get("bos_token", self.bos_piece or ""))
        eos = self._vocab.get(special_tokens.get("eos_token", self.eos_piece or ""))
        self._prefix = [bos] if add_bos and bos is not None else []
        self._suffix = [eos] if add_eos and eos is not None else []
        # A model that prepends "▁" (the dummy prefix) drops one leading space when decoding.
        self._strip_leading_space = sp.normalize("a").startswith("▁")

    def token_bytes(self) -> list[bytes]:
        out = []
        for i, piece in enumerate(self._pieces):
            if i in self.special_ids:
                out.append(b"")
            elif isinstance(piece, int):
                out.append(bytes([piece]))
            else:
                out.append(piece.encode("utf-8"))
        return out

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        parts: list[str | int] = []  # the text between special tokens, and their ids
        position = 0
        if self._split_re is not None:
            for match in self._split_re.finditer(text):
                if match.start() > position:
                    parts.append(text[position : match.start()])
                parts.append(self._splits[match.group()])
                position = match.end()
        if position < len(text):
            parts.append(text[position:])
        texts = [part for part in parts if isinstance(part, str)]
        encoded = iter(self._sp.encode(texts) if texts else [])
        ids = list(self._prefix) if add_special_tokens else []
        for part in parts:
            if isinstance(part, str):
                ids.extend(next(encoded))
            else:
                ids.append(part)
        if add_special_tokens:
            ids.extend(self._suffix)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        pieces, n = self._pieces, len(self._pieces)
        out: list[str] = []
        run = bytearray()  # consecutive byte pieces, decoded together
        for token_id in ids:
            if not 0 <= token_id < n or (skip_special_tokens and token_id in self.special_ids):
                continue
            piece = pieces[token_id]
            if isinstance(piece, int):
                run.append(piece)
                continue
            if run:
                out.append(_decode_byte_run(run))
                run = bytearray()
            out.append(piece)
        if run:
            out.append(_decode_byte_run(run))
        text = "".join(out)
        if self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._added:
            return self._added[token_id]
        if 0 <= token_id < self._sp.get_piece_size():
            return self._sp.id_to_piece(token_id)
        return None


def _decode_byte_run(run: bytearray) -> str:
    # Like tokenizers' ByteFallback decoder: all or nothing per run.
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)
