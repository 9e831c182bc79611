"""A vocabulary in tiktoken's format, encoded by the `tiktoken` package.

The file is text, one token per line: ``<base64 of the token's bytes> <rank>``;
the rank is the token id and the merge priority (byte-level BPE: every text
encodes, a byte the merges do not cover is its own token). It comes as
``*.tiktoken`` / ``tiktoken.model``, or as ``tokenizer.model`` in Meta's
original Llama 3 release (told apart from SentencePiece by its content:
SentencePiece files are binary protobuf).

What is read besides the ranks, matching transformers 5 (which converts such a
file with its TikTokenConverter):

* Added tokens: tokenizer_config.json ``added_tokens_decoder`` (id -> content),
  or legacy added_tokens.json. They are cut out of the text before BPE, longest
  first, and become their own ids; ``decode(..., skip_special_tokens=True)``
  drops all of them, even those marked ``"special": false`` (transformers'
  converter registers each as special). Meta's original folder has no
  tokenizer_config.json: put the one from the Hugging Face repo beside it.
* The split pattern: tokenizer_config.json ``pat_str`` (tiktoken's name for it)
  when present, else the Llama 3 / cl100k pattern, which transformers assumes.
* ``add_bos_token`` / ``add_eos_token`` (default False, as in transformers 5).

Token strings (``id_to_token``, ``token_to_id``) use the GPT-2 byte-to-unicode
alphabet ("Ġworld"), as transformers shows them.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import TokenizerError

# Llama 3's (= cl100k_base's) pre-tokenizer split pattern.
DEFAULT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MAX_RANK = 2**24  # ranks are token ids: Tokenizer's bound on the vocabulary
_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} [0-9]+\r?$")


def is_tiktoken_file(file: Path) -> bool:
    """Whether ``file`` starts like a tiktoken vocabulary (``base64 rank`` lines)."""
    with open(file, "rb") as f:
        head = f.read(4096)
    first = head.split(b"\n", 1)[0]
    return bool(_LINE.match(first))


def find_tiktoken_file(directory: Path) -> Path | None:
    """``tokenizer.model`` in tiktoken format, else ``tiktoken.model`` or the first ``*.tiktoken``."""
    model = directory / "tokenizer.model"
    if model.is_file() and is_tiktoken_file(model):
        return model
    if (directory / "tiktoken.model").is_file():
        return directory / "tiktoken.model"
    found = sorted(directory.glob("*.tiktoken"))
    return found[0] if found else None


def read_ranks(file: Path) -> dict[bytes, int]:
    """The ``token bytes -> rank`` table, with a one-line error naming the bad line."""
    ranks: dict[bytes, int] = {}
    try:
        lines = file.read_bytes().splitlines()
    except OSError as exc:
        raise TokenizerError(f"{file}: cannot read ({exc})") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected '<base64 token> <rank>'")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as exc:
            raise TokenizerError(
                f"{file}: line {number} is not '<base64 token> <rank>' ({exc})"
            ) from None
        if token in ranks:
            raise TokenizerError(f"{file}: line {number} repeats token {token!r}")
        if not 0 <= rank < MAX_RANK:
            raise TokenizerError(
                f"{file}: line {number} has rank {rank}, expected 0..{MAX_RANK - 1}"
            )
        ranks[token] = rank
    if not ranks:
        raise TokenizerError(f"{file}: empty tiktoken vocabulary")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{file}: byte-level vocabulary lacks {len(missing)} single bytes "
            f"(first: 0x{missing[0]:02X}); every byte needs a token"
        )
    return ranks


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable Latin-1 bytes map to themselves)."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


_TO_CHAR = _byte_alphabet()
_TO_BYTE = {c: b for b, c in _TO_CHAR.items()}


class TiktokenBackend:
    """Encode / decode a tiktoken vocabulary plus the checkpoint's added tokens.

    Args:
        file: the vocabulary (``base64 rank`` lines).
        added_tokens: id -> (content, special) from the side files (all count as special).
        special_tokens: the named special tokens (``bos_token``, ...) from the config.
        pattern: the pre-tokenizer split regex; None for the Llama 3 pattern.
        add_bos / add_eos: whether ``encode(..., add_special_tokens=True)`` adds them.
    """

    def __init__(
        self,
        file: Path,
        *,
        added_tokens: Mapping[int, tuple[str, bool]],
        special_tokens: Mapping[str, str],
        pattern: str | None,
        add_bos: bool,
        add_eos: bool,
    ) -> None:
        import tiktoken

        self.file = file
        ranks = read_ranks(file)
        pattern = pattern or DEFAULT_PATTERN
        if not isinstance(pattern, str):
            raise TokenizerError(
                f"{file.parent / 'tokenizer_config.json'}: 'pat_str' should be a string, "
                f"found {pattern!r}"
            )
        try:
            self._encoding = tiktoken.Encoding(
                file.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
            )
        except ValueError as exc:  # a pattern tiktoken's regex engine rejects
            raise TokenizerError(
                f"{file}: cannot build the tokenizer ({' '.join(str(exc).split())})"
            ) from exc
        self._ranks = ranks
        self._bytes: dict[int, bytes] = {rank: token for token, rank in ranks.items()}
        self._added: dict[int, str] = {}
        self._splits: dict[str, int] = {}  # added tokens, cut out of the text before BPE
        special_ids = set()
        for token_id, (content, _special) in sorted(added_tokens.items()):
            if not 0 <= token_id < MAX_RANK:
                raise TokenizerError(
                    f"{file.parent / 'tokenizer_config.json'}: added token {content!r:.40} has id "
                    f"{token_id}, expected 0..{MAX_RANK - 1}"
                )
            if self._bytes.get(token_id) == content.encode("utf-8"):
                continue  # an ordinary token listed again
            self._bytes.pop(token_id, None)
            self._added[token_id] = content
            self._splits[content] = token_id
            # transformers' converter registers every added token as special, and its
            # decode then skips them all, whatever "special" the config says.
            special_ids.add(token_id)

        self.vocab_size = max([*self._bytes, *self._added]) + 1
        self.special_ids = frozenset(special_ids)
        self.byte_fallback_ids: frozenset[int] = (
            frozenset()
        )  # byte-level: decoding is prefix-stable
        ordered = sorted(self._splits, key=len, reverse=True)  # longest first
        self._split_re = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        bos = self._splits.get(special_tokens.get("bos_token", ""))
        eos = self._splits.get(special_tokens.get("eos_token", ""))
        self._prefix = [bos] if add_bos and bos is not None else []
        self._suffix = [eos] if add_eos and eos is not None else []

    def token_bytes(self) -> list[bytes]:
        return [self._bytes.get(i, b"") for i in range(self.vocab_size)]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            text.encode("utf-8")  # tiktoken would quietly replace a lone surrogate
        except UnicodeEncodeError:
            raise TypeError(
                "text is not valid UTF-8"
            ) from None  # Tokenizer.encode names the character
        ids = list(self._prefix) if add_special_tokens else []
        position = 0
        if self._split_re is not None:
            for match in self._split_re.finditer(text):
                if match.start() > position:
                    ids.extend(self._encoding.encode_ordinary(text[position : match.start()]))
                ids.append(self._splits[match.group()])
                position = match.end()
        if position < len(text):
            ids.extend(self._encoding.encode_ordinary(text[position:]))
        if add_special_tokens:
            ids.extend(self._suffix)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        out: list[str] = []
        run = bytearray()  # ordinary tokens' bytes, decoded together (characters span tokens)
        for token_id in ids:
            piece = self._bytes.get(token_id)
            if piece is not None:
                run += piece
                continue
            content = self._added.get(token_id)
            if content is None or (skip_special_tokens and token_id in self.special_ids):
                continue  # outside the vocabulary, or skipped
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            out.append(content)
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        if token in self._splits:
            return self._splits[token]
        try:
            return self._ranks.get(bytes(_TO_BYTE[c] for c in token))
        except KeyError:
            return None  # not a byte-level token string

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._added:
            return self._added[token_id]
        piece = self._bytes.get(token_id)
        return None if piece is None else "".join(_TO_CHAR[b] for b in piece)
