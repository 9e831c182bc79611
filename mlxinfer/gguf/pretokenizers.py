"""How a byte-level BPE vocabulary splits text before its merges, by ``tokenizer.ggml.pre``.

Each name llama.cpp writes (src/llama-vocab.cpp adapts each split to its own regex engine) maps
to the model's own tokenizer.json split, which vocab.py builds into the tokenizer; checked
against llama.cpp's own tokenization in tests/gguf/test_gguf_vocab_pre.py.
"""

from __future__ import annotations

# llama.cpp pre-tokenizer names whose split is GPT-2's regex (byte-level BPE's own).
GPT2_PRE = (None, "gpt-2", "phi-2", "olmo", "mpt")
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
SPLITS: dict[str, tuple[tuple[str, ...], bool]] = {
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
