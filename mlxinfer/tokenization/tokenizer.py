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

The side files are read in tokenizer_config.py, tokenizer.json is run by
tokenizers_backend.py; streaming text comes from detokenizer.py, chat templates
from chat_template.py.
"""

from __future__ import annotations

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
from .tokenizer_config import added_tokens, config_flag, id_list, named_special_tokens, read_json
from .tokenizers_backend import TokenizersBackend

T = TypeVar("T")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "*.tiktoken")
MAX_VOCAB = 2**24  # token ids, added tokens included: config_check's bound on vocab_size


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
        config = read_json(path / "tokenizer_config.json")
        special_tokens = named_special_tokens(path, config)

        if (path / "tokenizer.json").is_file():
            file = path / "tokenizer.json"
            backend: _Backend = library_call(file, "load", TokenizersBackend, file)
        elif (tiktoken_file := find_tiktoken_file(path)) is not None:
            backend = library_call(
                tiktoken_file,
                "load",
                TiktokenBackend,
                tiktoken_file,
                added_tokens=added_tokens(path, config, special_tokens),
                special_tokens=special_tokens,
                pattern=config.get("pat_str"),
                add_bos=config_flag(path, config, "add_bos_token"),
                add_eos=config_flag(path, config, "add_eos_token"),
            )
        elif (path / "tokenizer.model").is_file():
            backend = library_call(
                path / "tokenizer.model",
                "load",
                SentencePieceBackend,
                path / "tokenizer.model",
                added_tokens=added_tokens(path, config, special_tokens),
                special_tokens=special_tokens,
                add_bos=config_flag(path, config, "add_bos_token"),
                add_eos=config_flag(path, config, "add_eos_token"),
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
            eos_token_ids.update(id_list(read_json(file).get("eos_token_id"), file, "eos_token_id"))

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
