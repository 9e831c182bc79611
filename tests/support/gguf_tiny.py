"""The tiny GGUF files the GGUF tests write: the tiny llama (every tensor type), the
reordering llama.cpp applies to q/k rows, byte-level and SentencePiece vocabularies."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

# ---------------------------------------------------------------------------
# helpers


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows (interleaves each head's RoPE halves)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_order(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama_cpp_permute."""
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def dequantized(weights: dict, module: str, quant: dict | None) -> np.ndarray:
    """A module's weight as float32; scales and biases widened first so nothing rounds in float16."""
    w = weights[f"{module}.weight"]
    if f"{module}.scales" not in weights:
        return np.array(w.astype(mx.float32))
    cfg = quant.get(module, quant)
    out = mx.dequantize(
        w,
        weights[f"{module}.scales"].astype(mx.float32),
        weights[f"{module}.biases"].astype(mx.float32),
        group_size=cfg["group_size"],
        bits=cfg["bits"],
    )
    return np.array(out)


def byte_alphabet() -> list[str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


# ---------------------------------------------------------------------------
# a tiny synthetic llama GGUF

N_HEADS, N_KV, HEAD_DIM, HIDDEN, FFN = 2, 1, 32, 64, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = SPECIALS + byte_alphabet() + ["Ġt", "he", "Ġthe"]
TINY_TYPES = {  # HF module -> (GGUF name, ggml type)
    "model.layers.0.self_attn.q_proj": ("blk.0.attn_q", T.Q4_1),
    "model.layers.0.self_attn.k_proj": ("blk.0.attn_k", T.Q4_0),
    "model.layers.0.self_attn.v_proj": ("blk.0.attn_v", T.Q8_0),
    "model.layers.0.self_attn.o_proj": ("blk.0.attn_output", T.F16),
    "model.layers.0.mlp.gate_proj": ("blk.0.ffn_gate", T.BF16),
    "model.layers.0.mlp.up_proj": ("blk.0.ffn_up", T.Q4_1),
    "model.layers.0.mlp.down_proj": ("blk.0.ffn_down", T.Q4_1),
    "model.embed_tokens": ("token_embd", T.Q8_0),
    "lm_head": ("output", T.Q4_0),
}
TINY_SHAPES = {
    "blk.0.attn_q": (N_HEADS * HEAD_DIM, HIDDEN),
    "blk.0.attn_k": (N_KV * HEAD_DIM, HIDDEN),
    "blk.0.attn_v": (N_KV * HEAD_DIM, HIDDEN),
    "blk.0.attn_output": (HIDDEN, N_HEADS * HEAD_DIM),
    "blk.0.ffn_gate": (FFN, HIDDEN),
    "blk.0.ffn_up": (FFN, HIDDEN),
    "blk.0.ffn_down": (HIDDEN, FFN),
    "token_embd": (len(TOKENS), HIDDEN),
    "output": (len(TOKENS), HIDDEN),
}


def write_tiny_gguf(
    path, *, arch="llama", extra_tensors=(), tokenizer_model="gpt2"
) -> dict[str, np.ndarray]:
    """Write a one-layer model; returns {GGUF tensor name: raw stored array} for reference checks."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template("{{ messages[0]['content'] }}")
    stored = {}
    for name, ggml_type in TINY_TYPES.values():
        x = rng.standard_normal(TINY_SHAPES[name]).astype(np.float32)
        if name == "blk.0.attn_q":
            x = llama_cpp_permute(x, N_HEADS)
        elif name == "blk.0.attn_k":
            x = llama_cpp_permute(x, N_KV)
        data = quantize(x, ggml_type)
        w.add_tensor(f"{name}.weight", data, raw_dtype=ggml_type)
        stored[name] = (data, ggml_type)
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{name}.weight", rng.standard_normal(HIDDEN).astype(np.float32))
    for name, data, ggml_type in extra_tensors:
        w.add_tensor(name, data, raw_dtype=ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def leftovers(parent, name):
    return sorted(p.name for p in parent.iterdir() if name in p.name)


# ---------------------------------------------------------------------------
# SentencePiece ("llama") vocabularies and the gemma3 architecture, on tiny synthetic files
# checked against transformers' own reading of the same file.

MULTILINGUAL = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "  two leading spaces, trailing   ",
    "tabs\tand\t\tnew\nlines\n\n\n  indented",
    "Numbers: 0 7 42 1234567 3.14159",
    "Café, naïve, résumé, über, straße — Ἀθῆναι. Добрый день, как дела?",
    "日本語のテキストです。中文文本测试，你好世界。한국어 텍스트입니다.",
    "مرحبا بالعالم. नमस्ते दुनिया. שלום עולם. emoji 😀🎉👍 🚀 👨‍👩‍👧 🇯🇵",
    "<s> special </s> in text <unk>",
    "",
    " ",
]


def sentencepiece_vocab(directory):
    """(tokens, scores, types) of a small Llama-2 style SentencePiece model, as llama.cpp writes them."""
    import sentencepiece
    from tokenizer_fixtures import build_sentencepiece

    sp = sentencepiece.SentencePieceProcessor(
        model_file=str(build_sentencepiece(directory) / "tokenizer.model")
    )
    n = sp.get_piece_size()
    types = [
        2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
        for i in range(n)
    ]
    return [sp.id_to_piece(i) for i in range(n)], [sp.get_score(i) for i in range(n)], types


def add_sentencepiece(w, vocab):
    tokens, scores, types = vocab
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
