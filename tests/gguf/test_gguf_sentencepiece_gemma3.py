"""SentencePiece ("llama") vocabularies and the gemma3 architecture, on tiny synthetic files
checked against transformers' own reading of the same file."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import quantize  # noqa: E402
from gguf_tiny import (  # noqa: E402
    FFN,
    HIDDEN,
    MULTILINGUAL,
    N_HEADS,
    add_sentencepiece,
    dequantized,
    finish,
    leftovers,
    sentencepiece_vocab,
)

from mlxinfer.errors import TokenizerError, WeightsError  # noqa: E402
from mlxinfer.gguf import import_gguf  # noqa: E402


@pytest.fixture(scope="module")
def spm_vocab(tmp_path_factory):
    return sentencepiece_vocab(tmp_path_factory.mktemp("spm"))


def test_sentencepiece_vocabulary_encodes_like_transformers(spm_vocab, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEADS)
    add_sentencepiece(w, spm_vocab)
    w.add_tensor("token_embd.weight", np.zeros((len(spm_vocab[0]), HIDDEN), np.float32))
    finish(w)
    import_gguf(tmp_path / "spm.gguf", tmp_path / "out")

    ours = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in MULTILINGUAL:
        ids = ours.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert ids[0] == 1  # BOS: llama.cpp's default for SentencePiece files
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        ), text
    assert ours.get_vocab() == ref.get_vocab()
    assert any(t.startswith("<0x") for t in ours.get_vocab())  # byte fallback pieces


# Gemma 3: a tiny model. head_dim 256 because transformers' GGUF loader leaves
# query_pre_attn_scalar at its default 256, while llama.cpp (and we) scale by head_dim;
# every released Gemma 3 but the 27B has head_dim 256, where the two agree.
G3 = dict(n_layers=6, hidden=64, heads=2, kv=1, head_dim=256, ffn=128)
G3_TYPES = [T.Q8_0, T.Q5_0, T.Q4_1, T.F16, T.Q5_1, T.Q4_0, T.F32]


def write_gemma3_gguf(path, vocab, *, sliding_window=4) -> dict[str, tuple[np.ndarray, int]]:
    """A gemma3 GGUF as llama.cpp writes one (norms stored as 1 + w); returns {name: (data, type)}."""
    rng = np.random.default_rng(0)
    hidden, heads, kv, head_dim, ffn = (
        G3["hidden"],
        G3["heads"],
        G3["kv"],
        G3["head_dim"],
        G3["ffn"],
    )
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(G3["n_layers"])
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    add_sentencepiece(w, vocab)
    w.add_add_bos_token(True)
    stored = {}

    def matrix(name, shape, ggml_type):
        x = (rng.standard_normal(shape) * 0.08).astype(np.float32)
        data = x if ggml_type == T.F32 else quantize(x, ggml_type)
        w.add_tensor(name, data, raw_dtype=None if ggml_type == T.F32 else ggml_type)
        stored[name] = (data, ggml_type)

    def norm(name, n):
        x = (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)
        w.add_tensor(name, x)
        stored[name] = (x, T.F32)

    matrix("token_embd.weight", (len(vocab[0]), hidden), T.Q8_0)
    norm("output_norm.weight", hidden)
    for i in range(G3["n_layers"]):
        shapes = [
            ("attn_q", (heads * head_dim, hidden)),
            ("attn_k", (kv * head_dim, hidden)),
            ("attn_v", (kv * head_dim, hidden)),
            ("attn_output", (hidden, heads * head_dim)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
        ]
        for j, (name, shape) in enumerate(shapes):
            matrix(f"blk.{i}.{name}.weight", shape, G3_TYPES[(i + j) % len(G3_TYPES)])
        for name, n in [
            ("attn_norm", hidden),
            ("attn_q_norm", head_dim),
            ("attn_k_norm", head_dim),
            ("post_attention_norm", hidden),
            ("ffn_norm", hidden),
            ("post_ffw_norm", hidden),
        ]:
            norm(f"blk.{i}.{name}.weight", n)
    finish(w)
    return stored


@pytest.fixture(scope="module")
def gemma3_tiny(spm_vocab, tmp_path_factory):
    """(our import, transformers' model and tokenizer from the same file)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("g3")
    write_gemma3_gguf(root / "g3.gguf", spm_vocab)
    import_gguf(root / "g3.gguf", root / "ours")
    ref = AutoModelForCausalLM.from_pretrained(
        str(root), gguf_file="g3.gguf", dtype=torch.float32
    ).eval()
    return root / "ours", ref, AutoTokenizer.from_pretrained(str(root), gguf_file="g3.gguf")


def test_gemma3_weights_equal_transformers_reading(gemma3_tiny):
    """Names mapped onto gemma3_text, norms stored as 1 + w brought back to w, every type exact."""
    ours_dir, ref, _ = gemma3_tiny
    ours = mx.load(str(ours_dir / "model.safetensors"))
    quant = json.loads((ours_dir / "config.json").read_text())["quantization"]
    state = {k: v.numpy() for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied
    assert {f"{k.rsplit('.', 1)[0]}.weight" for k in ours} == set(state)
    for key, value in state.items():
        np.testing.assert_array_equal(dequantized(ours, key.rsplit(".", 1)[0], quant), value, key)


def test_gemma3_config_matches_transformers(gemma3_tiny):
    ours_dir, ref, _ = gemma3_tiny
    ours = json.loads((ours_dir / "config.json").read_text())
    hf = ref.config.to_dict()
    for key in [
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "sliding_window",
        "layer_types",
        "rope_parameters",
        "query_pre_attn_scalar",
        "hidden_activation",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ]:
        assert ours[key] == hf[key], key
    assert np.float32(ours["rms_norm_eps"]) == np.float32(hf["rms_norm_eps"])


def test_gemma3_tokenizer_and_logits_match_transformers(gemma3_tiny):
    import torch

    from mlxinfer.loading.loader import load

    ours_dir, ref, ref_tok = gemma3_tiny
    model, tok = load(ours_dir, dtype=mx.float32)
    for text in MULTILINGUAL:
        assert tok.encode(text) == ref_tok(text).input_ids, text
    ids = tok.encode(MULTILINGUAL[4])  # 30+ tokens: past the sliding window of 4
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(np.array(model(mx.array([ids]))[0]) - expected).max() <= 1e-3


def test_gemma3_without_a_chat_template_gets_none_unless_named(gemma3_tiny):
    """A GGUF with no tokenizer.chat_template (a base model) gets no chat template; asked for
    by name, Gemma's turn format renders as transformers' Gemma 3 template does."""
    from mlxinfer.tokenization import Tokenizer

    tok = Tokenizer.from_dir(gemma3_tiny[0])
    assert not tok.has_chat_template
    assert "chat_template" not in json.loads((gemma3_tiny[0] / "tokenizer_config.json").read_text())
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    with pytest.raises(TokenizerError, match="expected one of chatml, gemma or a Jinja file"):
        tok.set_chat_template("gemmma")
    tok.set_chat_template("gemma")
    prompt = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
        add_generation_prompt=True,
    )
    assert prompt == (
        "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!"
        "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


def test_gemma3_missing_metadata_is_a_one_line_error(spm_vocab, tmp_path):
    write_gemma3_gguf(tmp_path / "g.gguf", spm_vocab, sliding_window=None)
    with pytest.raises(
        WeightsError, match="GGUF metadata lacks gemma3.attention.sliding_window"
    ) as e:
        import_gguf(tmp_path / "g.gguf", tmp_path / "out")
    assert "\n" not in str(e.value)
    assert leftovers(tmp_path, "out") == []
