"""Text <-> token ids for a checkpoint directory, chat templates, streaming text.

``Tokenizer.from_dir`` reads ``tokenizer.json`` with `tokenizers`; without one, a
tiktoken-format vocabulary (``tokenizer.model`` whose text is ``base64 rank``
lines, ``tiktoken.model`` or ``*.tiktoken``) with `tiktoken`, see
tiktoken_backend.py, or else ``tokenizer.model`` with `sentencepiece`; plus the
Hugging Face side files for special tokens and the chat template. Encoding and
decoding match what transformers 5's ``AutoTokenizer`` does for the same directory:

* With tokenizer.json, its post-processor alone decides whether ``encode`` adds
  BOS/EOS (transformers 5 drops ``add_bos_token`` / ``add_eos_token`` from
  tokenizer_config.json when a tokenizer.json exists).
* With tokenizer.model, ``add_bos_token`` / ``add_eos_token`` decide (default
  False, as in transformers 5); see sentencepiece_backend.py for the rest.

Streaming text comes from detokenizer.py, chat templates from chat_template.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..errors import TokenizerError
from .chat_template import (
    ChatTemplate,
    load_chat_templates,
    named_chat_template,
    select_chat_template,
)
from .detokenizer import StreamingDetokenizer
from .sentencepiece_backend import SentencePieceBackend
from .tiktoken_backend import TiktokenBackend, find_tiktoken_file

T = TypeVar("T")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "*.tiktoken")
MAX_VOCAB = 2**24  # token ids, added tokens included: config_check's bound on vocab_size
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


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, chat template, streaming detokenizer.

    Build it with :meth:`from_dir`.

    Attributes:
        bos_token_id: the BOS id, or None when the checkpoint names none.
        eos_token_ids: every id that ends generation: tokenizer_config.json's
            ``eos_token`` plus ``eos_token_id`` from generation_config.json and
            config.json (each an int or a list).
        vocab_size: number of token ids, added tokens included (transformers' ``len(tokenizer)``).
        special_tokens: the named special tokens (``bos_token``, ``eos_token``, ...)
            as strings; chat templates see them as variables.
        path: the checkpoint directory it was read from.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        special_tokens: dict[str, str],
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        chat_templates: dict[str, ChatTemplate],
        path: Path,
    ) -> None:
        self.path = path
        self._backend = backend
        if not 0 < backend.vocab_size <= MAX_VOCAB:
            raise TokenizerError(
                f"{backend.file}: {backend.vocab_size} token ids, expected 1..{MAX_VOCAB}"
            )
        self.special_tokens = special_tokens
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.vocab_size = backend.vocab_size
        self._chat_templates = chat_templates

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        """Load the tokenizer stored in a checkpoint directory.

        Raises:
            TokenizerError: no tokenizer.json / tokenizer.model, or a side file
                that is not valid JSON or has a key of the wrong type.
        """
        path = Path(path)
        if not path.is_dir():
            found = "a file" if path.exists() else "nothing"
            raise TokenizerError(
                f"{path}: expected a checkpoint directory with tokenizer files, found {found}"
            )
        config = _read_json(path / "tokenizer_config.json")
        special_tokens = _named_special_tokens(path, config)

        if (path / "tokenizer.json").is_file():
            file = path / "tokenizer.json"
            backend: _Backend = library_call(file, "load", _TokenizersBackend, file)
        elif (tiktoken_file := find_tiktoken_file(path)) is not None:
            backend = library_call(
                tiktoken_file,
                "load",
                TiktokenBackend,
                tiktoken_file,
                added_tokens=_added_tokens(path, config, special_tokens),
                special_tokens=special_tokens,
                pattern=config.get("pat_str"),
                add_bos=_flag(path, config, "add_bos_token"),
                add_eos=_flag(path, config, "add_eos_token"),
            )
        elif (path / "tokenizer.model").is_file():
            backend = library_call(
                path / "tokenizer.model",
                "load",
                SentencePieceBackend,
                path / "tokenizer.model",
                added_tokens=_added_tokens(path, config, special_tokens),
                special_tokens=special_tokens,
                add_bos=_flag(path, config, "add_bos_token"),
                add_eos=_flag(path, config, "add_eos_token"),
            )
            # Like transformers, the model's own <s> / </s> serve when the config names none.
            for key, piece in (("bos_token", backend.bos_piece), ("eos_token", backend.eos_piece)):
                if piece is not None:
                    special_tokens.setdefault(key, piece)
        else:
            raise TokenizerError(
                f"{path}: no tokenizer found, looked for {', '.join(TOKENIZER_FILES)}"
            )

        eos_token_ids = set()
        if (eos_id := _lookup(backend, special_tokens.get("eos_token"))) is not None:
            eos_token_ids.add(eos_id)
        for file in (path / "generation_config.json", path / "config.json"):
            eos_token_ids.update(
                _token_ids(_read_json(file).get("eos_token_id"), file, "eos_token_id")
            )

        return cls(
            backend,
            special_tokens=special_tokens,
            bos_token_id=_lookup(backend, special_tokens.get("bos_token")),
            eos_token_ids=frozenset(eos_token_ids),
            chat_templates=load_chat_templates(path, config),
            path=path,
        )

    # --- ids <-> text ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` BOS/EOS are added as the checkpoint says."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            # Both backends would reject it with a bare TypeError.
            raise TokenizerError(
                f"encode: text is not valid Unicode, found lone surrogate {text[exc.start]!r} at index {exc.start}"
            ) from None
        backend = self._backend
        return library_call(backend.file, "encode", backend.encode, text, add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ids outside the vocabulary are ignored."""
        backend = self._backend
        return library_call(backend.file, "decode", backend.decode, _ids(ids), skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. ``"<|im_end|>"``), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of one id, or None."""
        token_id = int(token_id)
        if not 0 <= token_id < 2**32:
            return None
        return library_call(self._backend.file, "id_to_token", self._backend.id_to_token, token_id)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids dropped by ``decode(..., skip_special_tokens=True)``."""
        return self._backend.special_ids

    def tokenizer_json(self) -> str | None:
        """The tokenizer.json this tokenizer runs, serialized (None for SentencePiece and
        tiktoken checkpoints: see :meth:`token_bytes`)."""
        to_str = getattr(self._backend, "to_str", None)
        return to_str() if to_str is not None else None

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes, as decoding it within a longer text gives them (b"" for a
        special or control token): what a grammar matches tokens against."""
        return self._backend.token_bytes()

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming detokenizer whose segments add up to ``decode(ids, skip_special_tokens)``."""
        backend = self._backend
        return StreamingDetokenizer(
            lambda ids: library_call(backend.file, "decode", backend.decode, ids, False),
            skip_ids=backend.special_ids if skip_special_tokens else (),
            byte_fallback_ids=backend.byte_fallback_ids,
            vocab_size=backend.vocab_size,
        )

    # --- chat ----------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    def set_chat_template(self, name_or_path: str) -> None:
        """Use this chat template instead of the checkpoint's (if any): a known format by name
        (``"gemma"``, ``"chatml"``) or a Jinja file."""
        self._chat_templates = {"default": named_chat_template(name_or_path)}

    def chat_template_source(self, *, tools: bool = False) -> str | None:
        """The Jinja source of the template :meth:`apply_chat_template` uses (with ``tools``:
        the one it uses when tools are given), or None without one."""
        if not self._chat_templates:
            return None
        return select_chat_template(self._chat_templates, use_tools=tools).source

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template, as transformers would.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``; keys set to None count as absent.
            add_generation_prompt: end with the header that starts an assistant turn.
            **kwargs: extra template variables, e.g. ``tools=[...]`` (which also picks a
                ``tool_use`` template when there is one), ``documents``, ``enable_thinking``.
                They override the special-token variables (``bos_token``, ...).

        Returns:
            The prompt text. Encode it with ``add_special_tokens=False``: the template
            already wrote BOS where the model wants it.
        """
        if not self._chat_templates:
            raise TokenizerError(
                f"{self.path}: no chat template, looked for chat_template.jinja, chat_template.json "
                "and tokenizer_config.json['chat_template']"
            )
        template = select_chat_template(
            self._chat_templates, use_tools=kwargs.get("tools") is not None
        )
        return template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            variables={**self.special_tokens, **kwargs},
        )


# --- backends ------------------------------------------------------------------------------------


class _Backend(Protocol):
    file: Path  # the file the library reads, named in errors
    vocab_size: int
    special_ids: frozenset[int]  # what decode(skip_special_tokens=True) drops
    byte_fallback_ids: frozenset[int]  # <0xNN> tokens, when decode fuses runs of them

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, token_id: int) -> str | None: ...
    def token_bytes(self) -> list[bytes]: ...


class _TokenizersBackend:
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


# --- side files ----------------------------------------------------------------------------------


def _read_json(file: Path) -> dict[str, Any]:
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


def _named_special_tokens(path: Path, config: dict[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as strings.

    transformers' rule: when tokenizer_config.json has no ``added_tokens_decoder``
    (older checkpoints), special_tokens_map.json overrides its values.
    """
    sources = [(path / "tokenizer_config.json", config)]
    if "added_tokens_decoder" not in config:
        sources.append(
            (path / "special_tokens_map.json", _read_json(path / "special_tokens_map.json"))
        )
    tokens = {}
    for file, data in sources:
        for key in _NAMED_TOKENS:
            if data.get(key) is not None:
                tokens[key] = _token_content(data[key], file, key)
    return tokens


def _added_tokens(
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
        for content, token_id in _read_json(path / "added_tokens.json").items():
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise TokenizerError(
                    f"{path / 'added_tokens.json'}: {content!r} should map to an integer id, found {token_id!r}"
                )
            added[token_id] = (content, content in special_tokens.values())
    return added


def _flag(path: Path, config: dict[str, Any], key: str) -> bool:
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


def _token_ids(value: Any, file: Path, key: str) -> list[int]:
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


def _lookup(backend: _Backend, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


def _ids(ids: Iterable[int]) -> list[int]:
    try:
        return [int(i) for i in ids]
    except (TypeError, ValueError, OverflowError) as exc:
        raise TokenizerError(f"decode: expected token ids (ints), {exc}") from None


# --- the libraries' failures ---------------------------------------------------------------------


def library_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a tokenizer library failing on its input: any Exception, or a Rust
    panic from `tokenizers` (pyo3's PanicException derives from BaseException, so a plain
    ``except Exception`` lets it through), but not KeyboardInterrupt or SystemExit."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def library_call(file: Path, action: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs)``, with a failure of the tokenizer library behind it (an
    exception or a panic, see :func:`library_failure`) raised as a one-line TokenizerError
    naming ``file`` and ``action``."""
    try:
        return call(*args, **kwargs)
    except TokenizerError:
        raise
    except BaseException as exc:
        if not library_failure(exc):
            raise
        reason = " ".join(str(exc).split())[:200] or "no message"
        raise TokenizerError(f"{file}: {action} failed ({type(exc).__name__}: {reason})") from exc
