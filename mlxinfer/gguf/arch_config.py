"""config.json from a GGUF file's metadata, in transformers 5's form, for each architecture.

``make_config`` reads the ``<arch>.*`` keys through typed, range-checked lookups (metadata.py;
a wrong type or range is a ConfigError naming the key, a needed key that is absent a
WeightsError), checks them against the tensors (embedding rows and width, head sizes), and
adds what llama.cpp hard-codes for each family (names.py's notes list it). Every size is
bounded (``MAX_*``, lookups.py), so nothing sized from the metadata is a hostile allocation. The
families' own keys: arch_families.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ..errors import ConfigError, WeightsError
from . import metadata as meta
from .arch_families import ARCH_CONFIG
from .lookups import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    Meta,
    f32,
    kv_heads_per_layer,
)


def _token_ids(path: Path, md: dict, config: dict, rows: int) -> None:
    """BOS, EOS and padding ids. BOS is fed to the model, so it must be an embedding row;
    EOS and padding are only compared against, so one past the rows is dropped with a warning."""
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):  # fmt: skip
        full = f"tokenizer.ggml.{gguf_key}"
        i = meta.integer(path, md, full, lo=-(2**63), hi=2**64, default=None)
        if i is None:
            continue
        if not 0 <= i < rows and key == "bos_token_id":
            raise ConfigError(
                f"{path}: {full}: expected a token id in [0, {rows}) (token_embd.weight's rows; "
                f"BOS is fed to the model), found {i}"
            )
        if not 0 <= i < rows:
            warnings.warn(
                f"{path}: {full} is {i}, past the {rows} embedding rows; ignored",
                RuntimeWarning,
                stacklevel=4,
            )
            continue
        config[key] = i


def _embedding(path: Path, md: dict, tensors: dict) -> tuple[int, int]:
    """token_embd.weight's (rows, width); the vocabulary may not name more tokens than rows."""
    shape = tensors["token_embd.weight"].shape
    if len(shape) != 2:
        raise WeightsError(
            f"{path}: tensor token_embd.weight has shape {shape}; expected (vocab, hidden)"
        )
    tokens = md.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > shape[0]:
        raise ConfigError(
            f"{path}: tokenizer.ggml.tokens: expected at most {shape[0]} tokens "
            f"(token_embd.weight's rows), found {len(tokens)}"
        )
    return shape


def make_config(arch: str, path: Path, md: dict, tensors: dict, read=None) -> dict:
    """config.json for the model the GGUF describes, in transformers 5's form (``read``: a
    tensor's values, for settings stored as a tensor: Llama 3.1's ``rope_freqs``)."""
    m = Meta(path, md, arch, read)
    moe = arch in ("qwen3moe", "gpt-oss", "glm4moe", "qwen35moe", "qwen3next", "deepseek2")
    experts = m.integer("expert_count", lo=0, hi=MAX_EXPERTS, default=0)
    if experts and not moe:
        raise WeightsError(
            f"{path}: {arch}.expert_count={experts}: mixture-of-experts GGUF not supported"
        )
    rows, width = _embedding(path, md, tensors)
    hidden = m.integer("embedding_length", hi=MAX_WIDTH)
    if hidden != width:
        raise m.error("embedding_length", f"{width} (token_embd.weight's width)", hidden)
    n_heads = m.integer("attention.head_count", hi=MAX_HEADS)
    per_layer = kv_heads_per_layer(m, n_heads)  # LFM2: 0 for its convolution layers
    if per_layer is not None:
        n_kv = max(per_layer)
    else:
        n_kv = m.integer("attention.head_count_kv", hi=n_heads, default=n_heads)
    if n_heads % n_kv:
        raise m.error("attention.head_count_kv", f"a divisor of the {n_heads} heads", n_kv)
    # RoPE turns pairs of channels: every head size is even
    if f"{arch}.attention.key_length" in md:
        head_dim = m.integer("attention.key_length", hi=MAX_WIDTH)
        if head_dim % 2:
            raise m.error("attention.key_length", "an even head size", head_dim)
    elif hidden % n_heads or hidden // n_heads % 2:
        expected = f"a divisor of the width {hidden} giving an even head size"
        raise m.error("attention.head_count", expected, n_heads)
    else:
        head_dim = hidden // n_heads
    vocab = m.integer("vocab_size", hi=MAX_VOCAB, default=rows)
    if vocab != rows:
        raise m.error("vocab_size", f"{rows} (token_embd.weight's rows)", vocab)
    eps_default = 1e-5 if arch in ("llama", "gpt-oss") else 1e-6
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": m.integer("block_count", hi=MAX_LAYERS),
        # a mixture of experts may have no dense FFN at all
        "intermediate_size": m.integer("feed_forward_length", lo=0 if moe else 1, hi=MAX_WIDTH),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": f32(
            m.number("attention.layer_norm_rms_epsilon", hi=1.0, default=eps_default)
        ),
        "vocab_size": vocab,
        "max_position_embeddings": m.integer("context_length", hi=MAX_CONTEXT),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    rope_theta = f32(m.number("rope.freq_base", default=10000.0))
    config = ARCH_CONFIG[arch](m, tensors, config, rope_theta)
    _token_ids(path, md, config, rows)
    return config
