"""Rebuild a Hugging Face ``tokenizer.json`` from a GGUF file's vocabulary metadata.

Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: tokens, merges,
token types, special-token ids, chat template).
"""

from __future__ import annotations

from pathlib import Path

from .errors import TokenizerError


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable bytes map to themselves, the rest to 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# llama.cpp pre-tokenizer names whose split is GPT-2's regex. 'smollm' also isolates
# digits, which changes nothing when (as in SmolLM2) no token holds a digit and another character.
_GPT2_PRE = (None, "gpt-2", "smollm")


def build_tokenizer(path: Path, md: dict) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config dict) for a byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.pre")
    if kind != "gpt2":
        raise TokenizerError(f"{path}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) is supported")
    if pre not in _GPT2_PRE:
        raise TokenizerError(f"{path}: tokenizer.ggml.pre is {pre!r}; supported: 'gpt-2', 'smollm'")
    tokens = md["tokenizer.ggml.tokens"]
    types = [int(t) for t in md.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    # A token spelled outside the byte alphabet (raw spaces, say) is respelled byte by byte.
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab[tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))] = i
    merges = []
    for m in md.get("tokenizer.ggml.merges", []):
        pair = m.split(" ")
        if len(pair) != 2:
            raise TokenizerError(f"{path}: tokenizer.ggml.merges entry {m!r} is not two tokens")
        merges.append(tuple(pair))

    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (type 3) stay whole and count as special; user-defined ones (type 4)
    # stay whole but are ordinary text. A control token outside the alphabet is a mislabel.
    control = [t for t, ty in zip(tokens, types) if ty == 3 and set(t) <= alphabet]
    user = [t for t, ty in zip(tokens, types) if ty == 4 and t in vocab]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def token(key):
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and int(i) < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(md.get("llama.context_length", 2048)),
    }
    if "tokenizer.chat_template" in md:
        config["chat_template"] = md["tokenizer.chat_template"]
    return tok.to_str(), config
