"""Rebuild a Hugging Face ``tokenizer.json`` from a GGUF file's vocabulary metadata.

Two vocabularies, each rebuilt the way transformers 5's GGUF loader builds it,
so that both encode text to the same ids:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from tokens and merges,
  split before BPE by GPT-2's regex or, as ``tokenizer.ggml.pre`` says, the model's own
  (pretokenizers.py: Llama 3, Qwen2/3/3.5, GLM-4, LFM2, o200k, Tekken, DeepSeek, ...). No
  NFC normalizer: neither llama.cpp nor transformers' GGUF reader applies one.
- ``tokenizer.ggml.model == "llama"``: SentencePiece, as a `tokenizers` BPE
  with byte fallback (``<0xNN>`` pieces for bytes no token covers). The file
  has tokens, scores and token types but no merges; the merges are recovered
  from the vocabulary (:func:`sentencepiece_merges`). Gemma files differ in
  three ways (``general.architecture`` gemma*): their merge order is the
  tokens' file order rather than their scores, whitespace-only tokens are
  stored with real spaces instead of "▁", and text goes through
  ``" " -> "▁"`` instead of Metaspace (no prefix space).

Control tokens (type 3) become special added tokens, user-defined ones (type 4)
ordinary added tokens; BOS/EOS are added by the post-processor as
``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say (SentencePiece files
that do not say add BOS, like llama.cpp). The chat template is carried over;
a file without one (a base model) gets none: its prompts go to the model as
they are, unless the user names a format (``--chat-template gemma``).

Every key is read with its type checked (metadata.py), every merge is checked against
the vocabulary before `tokenizers` sees it (it panics on some bad merges), and anything
`tokenizers` still refuses, a panic included, is a ``TokenizerError`` naming the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import MlxInferError, TokenizerError
from . import metadata as meta
from .pretokenizers import GPT2_PRE, SPLITS

MAX_PIECE = 1024  # characters in one SentencePiece token: merges are found in O(length^2)


def _kw(**more) -> dict:
    """Keyword arguments of the metadata readers for tokenizer keys: errors are TokenizerErrors."""
    return {"error": TokenizerError, "missing": TokenizerError, **more}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable bytes map to themselves, the rest to 256+."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
CONTROL, USER_DEFINED = 3, 4


def build_tokenizer(path: Path, md: dict) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config dict) for the file's vocabulary."""
    try:
        return _build(path, md)
    except MlxInferError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # tokenizers' Rust panics arrive as pyo3's PanicException
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise TokenizerError(
            f"{path}: the vocabulary cannot be built: {type(e).__name__}: {first}"
        ) from None


def _build(path: Path, md: dict) -> tuple[str, dict]:
    kind = meta.string(path, md, "tokenizer.ggml.model", **_kw(default=None))
    if kind not in ("gpt2", "llama"):
        raise TokenizerError(
            f"{path}: tokenizer.ggml.model is {kind!r:.80}; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece)"
        )
    tokens = meta.strings(path, md, "tokenizer.ggml.tokens", **_kw())
    if not tokens:
        raise TokenizerError(f"{path}: tokenizer.ggml.tokens: expected at least one token, found 0")
    if kind == "gpt2":
        tok, add_bos_default = _byte_level(path, md, tokens), False
    else:
        tok, add_bos_default = _sentencepiece(path, md, tokens), True

    def token(key):  # an id outside the vocabulary names no token
        i = meta.integer(
            path, md, f"tokenizer.ggml.{key}", **_kw(lo=-(2**63), hi=2**64, default=None)
        )
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    arch = meta.string(path, md, "general.architecture", **_kw(default="llama"))
    flag = {"default": False, "error": TokenizerError}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": meta.boolean(
            path, md, "tokenizer.ggml.add_bos_token", **{**flag, "default": add_bos_default}
        ),
        "add_eos_token": meta.boolean(path, md, "tokenizer.ggml.add_eos_token", **flag),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.integer(
            path, md, f"{arch}.context_length", **_kw(hi=2**64, default=2048)
        ),
    }
    if kind == "llama":
        _sentencepiece_specials(path, tok, md, tokens, config, gemma=arch in _GEMMA_ARCHS)
    if kind == "llama" or config["add_bos_token"] or config["add_eos_token"]:
        _bos_eos_post_processor(tok, config)
    template = meta.string(path, md, "tokenizer.chat_template", **_kw(default=None))
    if template is not None:  # a file without one (a base model) gets none
        config["chat_template"] = template
    return tok.to_str(), config


def _types(path: Path, md: dict, n: int) -> list[int]:
    """tokenizer.ggml.token_type: one integer per token (all normal, 1, if absent)."""
    types = meta.numbers(
        path, md, "tokenizer.ggml.token_type", n, **_kw(integers=True, default=None)
    )
    return [1] * n if types is None else types.tolist()


# ---------------------------------------------------------------------------
# byte-level BPE


def _byte_level(path: Path, md: dict, tokens: list[str]):
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    pre = meta.string(path, md, "tokenizer.ggml.pre", **_kw(default=None))
    if pre not in GPT2_PRE and pre not in SPLITS:
        raise TokenizerError(
            f"{path}: tokenizer.ggml.pre is {pre!r:.80}; supported: "
            + ", ".join(repr(p) for p in (*GPT2_PRE[1:], *SPLITS))
        )
    types = _types(path, md, len(tokens))
    # A token spelled outside the byte alphabet (raw spaces, say) is respelled byte by byte.
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab[
            tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
        ] = i
    merges = []
    for m in meta.strings(path, md, "tokenizer.ggml.merges", **_kw(default=[])):
        pair = m.split(" ")
        if len(pair) != 2:
            raise TokenizerError(f"{path}: tokenizer.ggml.merges entry {m!r:.80} is not two tokens")
        # tokenizers needs both parts and their join in the vocabulary (it panics on some)
        missing = next((t for t in (*pair, "".join(pair)) if t not in vocab), None)
        if missing is not None:
            raise TokenizerError(
                f"{path}: tokenizer.ggml.merges entry {m!r:.80}: expected tokens of the vocabulary, "
                f"found {missing!r:.80} in none"
            )
        merges.append(tuple(pair))

    splits, whole = SPLITS.get(pre, ((), False))
    tok = Tokenizer(
        models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=whole)
    )
    if pre in SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (type 3) stay whole and count as special; user-defined ones (type 4)
    # stay whole but are ordinary text. A control token outside the alphabet is a mislabel.
    control = [t for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet]
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


# ---------------------------------------------------------------------------
# SentencePiece


def sentencepiece_merges(tokens: list[str], priority: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    Every token that splits into two tokens gives one merge per split; merges
    rank by their token's ``priority`` (higher first), then by longer left and
    right pieces. Within a token, splits are first ordered by the pieces' ids and
    the ranking sort is stable, so equal priorities keep that order -- the same
    list transformers derives.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    candidates = []
    for token, score in priority.items():
        splits = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        candidates.extend((left, right, score) for left, right in splits)
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _sentencepiece(path: Path, md: dict, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    longest = max(tokens, key=len)
    if len(longest) > MAX_PIECE:
        raise TokenizerError(
            f"{path}: tokenizer.ggml.tokens: expected tokens of at most {MAX_PIECE} characters, "
            f"found one of {len(longest)}"
        )
    tokens = list(tokens)
    gemma = md.get("general.architecture") in _GEMMA_ARCHS
    if gemma:
        # Gemma files store whitespace-only tokens with real spaces; the model looks them up as "▁".
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority = {t: -i for i, t in enumerate(tokens)}  # merge order = file order
    else:
        if "tokenizer.ggml.scores" not in md:
            raise TokenizerError(f"{path}: SentencePiece vocabulary without tokenizer.ggml.scores")
        scores = meta.numbers(path, md, "tokenizer.ggml.scores", len(tokens), **_kw(integers=False))
        priority = dict(zip(tokens, np.asarray(scores, dtype=np.float32).tolist()))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, priority)

    if gemma:
        tok = Tokenizer(
            models.BPE(vocab, merges, fuse_unk=True, unk_token="<unk>", byte_fallback=True)
        )
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    else:  # Llama-2 style: a "▁" before the first word only, stripped again when decoding
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    return tok


def _sentencepiece_specials(
    path: Path, tok, md: dict, tokens: list[str], config: dict, gemma: bool
) -> None:
    from tokenizers import AddedToken

    types = _types(path, md, len(tokens))
    vocab = tok.get_vocab()
    named = [
        config[k] for k in ("pad_token", "eos_token", "bos_token", "unk_token") if config.get(k)
    ]
    if gemma and "<mask>" in vocab:
        named.append("<mask>")  # GemmaTokenizer's mask token
    control = [t for t, ty in zip(tokens, types) if ty == CONTROL]
    specials = list(dict.fromkeys(named + control))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    user = [
        t for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab and t not in specials
    ]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _bos_eos_post_processor(tok, config: dict) -> None:
    """BOS / EOS as transformers' TemplateProcessing writes them (a pair gets BOS before each part)."""
    from tokenizers import processors

    vocab = tok.get_vocab()
    bos = config["bos_token"] if config["add_bos_token"] else None
    eos = config["eos_token"] if config["add_eos_token"] else None
    config["add_bos_token"], config["add_eos_token"] = bos is not None, eos is not None
    single = " ".join([f"{bos}:0"] * bool(bos) + ["$A:0"] + [f"{eos}:0"] * bool(eos))
    pair = single + " " + " ".join([f"{bos}:1"] * bool(bos) + ["$B:1"] + [f"{eos}:1"] * bool(eos))
    specials_ids = [(t, vocab[t]) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials_ids
    )
