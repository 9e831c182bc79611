"""Rebuild a Hugging Face ``tokenizer.json`` from a GGUF file's vocabulary metadata.

Two vocabularies, each rebuilt the way transformers 5's GGUF loader builds it,
so that both encode text to the same ids:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from tokens and merges,
  split before BPE by GPT-2's regex or, as ``tokenizer.ggml.pre`` says, the model's own
  (``_SPLITS``: Qwen2/3, Qwen3.5, Llama 3, GLM-4, gpt-oss's o200k, DeepSeek-V3 and -LLM). No
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


# llama.cpp pre-tokenizer names whose split is GPT-2's regex (byte-level BPE's own).
_GPT2_PRE = (None, "gpt-2", "phi-2", "olmo", "mpt")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# ...and those with their own split, as the model's own tokenizer.json splits (llama.cpp's
# llama-vocab.cpp adapts each to its regex engine): (regexes applied in turn, each isolating its
# matches within the pieces the one before left; whether a piece that is itself a token skips
# the merges, llama.cpp's ``ignore_merges``).
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (  # Llama 3's, and GLM-4's (llama.cpp's CHATGLM4 split is the same)
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS: dict[str, tuple[tuple[str, ...], bool]] = {
    "qwen2": ((_QWEN2,), False),  # Qwen2/Qwen3 (single digits)
    "deepseek-r1-qwen": ((_QWEN2,), False),
    "qwen35": (  # Qwen3.5/3.6: combining marks join the letters
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
            r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        False,
    ),
    **{
        name: ((_LLAMA3,), True)  # llama.cpp's LLAMA3 names (LFM2's too) and GLM-4's
        for name in (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "lfm2",
            "glm4",
            "glm5",
        )  # fmt: skip
    },
    "dbrx": ((_LLAMA3,), False),  # Llama 3's split without ignore_merges (OLMo 2's cl100k)
    "smaug-bpe": ((_LLAMA3,), False),
    # digits one by one, then GPT-2's split (SmolLM, StarCoder, Command-R, EXAONE)
    **{
        name: ((r"\p{N}", _GPT2), False)
        for name in ("smollm", "starcoder", "command-r", "exaone", "refact")
    },  # fmt: skip
    "tekken": (  # Mistral's Tekken (Nemo, Small 3, Ministral): o200k's without contractions
        (
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
            r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        True,
    ),
    "gpt-4o": (  # gpt-oss's o200k
        (
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        False,
    ),
    # (the DeepSeek classes as escapes: these code points must not meet a Unicode normalizer)
    "deepseek-v3": (  # DeepSeek-V3/R1: digits in threes, CJK and kana runs, words, punctuation
        (
            "\\p{N}{1,3}",
            "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
            "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
            "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
        ),
        False,
    ),
    "deepseek-llm": (  # DeepSeek-LLM and V2: newlines, Latin/Greek/Cyrillic/... words, ...
        (
            "[\r\n]",
            "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
            "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
            "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
            "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
            "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
            "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
            "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
            "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
            "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
            "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
            "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
            "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
            "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
            "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            "\\s+$",
            "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
            "\\p{N}+",
        ),
        False,
    ),
}
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
    if pre not in _GPT2_PRE and pre not in _SPLITS:
        raise TokenizerError(
            f"{path}: tokenizer.ggml.pre is {pre!r:.80}; supported: "
            + ", ".join(repr(p) for p in (*_GPT2_PRE[1:], *_SPLITS))
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

    splits, whole = _SPLITS.get(pre, ((), False))
    tok = Tokenizer(
        models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=whole)
    )
    if pre in _SPLITS:
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
