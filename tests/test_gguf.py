"""import_gguf: GGUF (llama, Q4_0/Q4_1/Q8_0/F16/BF16/F32, byte-level BPE) -> model directory.

Two kinds of evidence:
  * a tiny synthetic GGUF written with the ``gguf`` package, covering every tensor
    type and the error paths in milliseconds;
  * the real SmolLM2-135M-Instruct Q4_1 file, against the ``gguf`` package's
    reference dequantizer and against transformers' own reading of the same file.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from mlxinfer.errors import MlxInferError, TokenizerError, WeightsError  # noqa: E402
from mlxinfer.gguf import import_gguf  # noqa: E402

# ---------------------------------------------------------------------------
# helpers


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows (interleaves each head's RoPE halves)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_order(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama_cpp_permute."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


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


def write_tiny_gguf(path, *, arch="llama", extra_tensors=(), tokenizer_model="gpt2") -> dict[str, np.ndarray]:
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf path, stored tensors, imported dir, report)"""
    root = tmp_path_factory.mktemp("tiny")
    stored = write_tiny_gguf(root / "tiny.gguf")
    report = import_gguf(root / "tiny.gguf", root / "model")
    return root / "tiny.gguf", stored, root / "model", report


def leftovers(parent, name):
    return sorted(p.name for p in parent.iterdir() if name in p.name)


# ---------------------------------------------------------------------------
# synthetic: every type, exactly


def test_every_type_dequantizes_bit_exact_and_qk_rows_are_unpermuted(tiny):
    _, stored, model_dir, _ = tiny
    weights = mx.load(str(model_dir / "model.safetensors"))
    quant = json.loads((model_dir / "config.json").read_text())["quantization"]
    for module, (name, _) in TINY_TYPES.items():
        data, ggml_type = stored[name]
        ref = dequantize(data, ggml_type).astype(np.float32)
        if name == "blk.0.attn_q":
            ref = hf_order(ref, N_HEADS)
        elif name == "blk.0.attn_k":
            ref = hf_order(ref, N_KV)
        np.testing.assert_array_equal(dequantized(weights, module, quant), ref, err_msg=module)


def test_mixed_types_are_recorded_per_module(tiny):
    _, _, model_dir, report = tiny
    config = json.loads((model_dir / "config.json").read_text())
    q8 = {"group_size": 32, "bits": 8, "mode": "affine"}
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": q8,
        "model.layers.0.self_attn.v_proj": q8,
        "model.layers.0.self_attn.o_proj": False,  # F16 stays float
        "model.layers.0.mlp.gate_proj": False,  # BF16 stays float
    }
    assert report["quantization"] == config["quantization"]
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert weights["model.layers.0.self_attn.o_proj.weight"].dtype == mx.float16
    assert weights["model.layers.0.mlp.gate_proj.weight"].dtype == mx.bfloat16
    assert weights["model.norm.weight"].dtype == mx.float32
    assert config["tie_word_embeddings"] is False and "lm_head.weight" in weights
    assert config["rope_theta"] == 500000.0 and config["rms_norm_eps"] == 1e-6
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 32)


def test_tiny_tokenizer_keeps_specials_whole_and_adds_bos_flag(tiny):
    from tokenizers import Tokenizer

    _, _, model_dir, _ = tiny
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode("<|im_start|>the the<|im_end|>").ids
    assert [TOKENS[i] for i in ids] == ["<|im_start|>", "t", "he", "Ġthe", "<|im_end|>"]
    assert tok.decode(ids, skip_special_tokens=True) == "the the"
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is True
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_config["chat_template"] == "{{ messages[0]['content'] }}"


def test_report_counts_parameters_and_bytes(tiny):
    _, _, model_dir, report = tiny
    n = sum(r * c for r, c in TINY_SHAPES.values()) + 3 * HIDDEN
    assert report["n_params"] == n
    assert report["bytes"] == sum(p.stat().st_size for p in model_dir.iterdir())
    assert 4 < report["bits_per_weight"] < 16


# ---------------------------------------------------------------------------
# errors: one line, naming the problem; nothing left behind


def test_truncated_file_raises_and_leaves_nothing(tiny, tmp_path):
    src, _, _, _ = tiny
    data = src.read_bytes()
    for cut, words in [(len(data) - 100, "truncated GGUF: tensor"), (300, "truncated GGUF header"), (2, "magic")]:
        bad = tmp_path / "cut.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(WeightsError, match=words) as e:
            import_gguf(bad, tmp_path / "out")
        assert "\n" not in str(e.value) and str(bad) in str(e.value)
        assert leftovers(tmp_path, "out") == []


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightsError, match="general.architecture is 'bert'; only 'llama'"):
        import_gguf(tmp_path / "bert.gguf", tmp_path / "out")
    assert leftovers(tmp_path, "out") == []


def test_unsupported_tensor_type(tmp_path):
    q6k = np.zeros((2, 210), np.uint8)  # two Q6_K blocks of 256 weights
    write_tiny_gguf(tmp_path / "k.gguf", extra_tensors=[("blk.0.extra.weight", q6k, T.Q6_K)])
    with pytest.raises(WeightsError, match="tensor blk.0.extra.weight has unsupported type Q6_K"):
        import_gguf(tmp_path / "k.gguf", tmp_path / "out")
    assert leftovers(tmp_path, "out") == []


def test_sentencepiece_vocabulary_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model is 'llama'"):
        import_gguf(tmp_path / "spm.gguf", tmp_path / "out")
    assert leftovers(tmp_path, "out") == []


def test_existing_destination_is_not_overwritten(tiny, tmp_path):
    src = tiny[0]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(MlxInferError, match="not empty"):
        import_gguf(src, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


# ---------------------------------------------------------------------------
# the real SmolLM2-135M-Instruct Q4_1 file


@pytest.fixture(scope="module")
def smollm2():
    """(gguf path, our import, transformers' float32 checkpoint) -- all cached on disk."""
    from fixtures import smollm2_gguf_path, smollm2_hf_dir, smollm2_mlx_dir

    return smollm2_gguf_path(), smollm2_mlx_dir(), smollm2_hf_dir()


@pytest.mark.real
def test_real_weights_bit_exact_vs_gguf_reference(smollm2):
    gguf_path, mlx_dir, _ = smollm2
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    ours = mx.load(str(mlx_dir / "model.safetensors"))
    quant = json.loads((mlx_dir / "config.json").read_text())["quantization"]
    cases = [
        ("blk.4.ffn_up.weight", "model.layers.4.mlp.up_proj", None),  # Q4_1
        ("blk.29.attn_output.weight", "model.layers.29.self_attn.o_proj", None),  # Q4_1
        ("token_embd.weight", "model.embed_tokens", None),  # Q8_0
        ("blk.11.attn_q.weight", "model.layers.11.self_attn.q_proj", 9),  # Q4_1, permuted by 9 heads
        ("blk.11.attn_k.weight", "model.layers.11.self_attn.k_proj", 3),  # ... by 3 kv heads
    ]
    for name, module, n_heads in cases:
        t = tensors[name]
        ref = dequantize(t.data, t.tensor_type)
        if n_heads:
            ref = hf_order(ref, n_heads)
        np.testing.assert_array_equal(dequantized(ours, module, quant), ref, err_msg=name)


@pytest.mark.real
def test_real_weights_equal_transformers_checkpoint(smollm2):
    """transformers dequantizes and un-permutes when it reads a GGUF; we must agree bit for bit."""
    _, mlx_dir, hf_dir = smollm2
    ours = mx.load(str(mlx_dir / "model.safetensors"))
    hf = mx.load(str(hf_dir / "model.safetensors"))
    quant = json.loads((mlx_dir / "config.json").read_text())["quantization"]
    modules = {k.rsplit(".", 1)[0] for k in ours}
    assert {f"{m}.weight" for m in modules} == set(hf)
    for module in [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.17.self_attn.q_proj",
        "model.layers.17.self_attn.k_proj",
        "model.layers.17.self_attn.v_proj",
        "model.layers.17.mlp.down_proj",
        "model.embed_tokens",
        "model.layers.3.input_layernorm",
        "model.norm",
    ]:
        np.testing.assert_array_equal(dequantized(ours, module, quant), np.array(hf[f"{module}.weight"]), module)


@pytest.mark.real
def test_real_config_matches_metadata_and_transformers(smollm2):
    _, mlx_dir, hf_dir = smollm2
    ours = json.loads((mlx_dir / "config.json").read_text())
    hf = json.loads((hf_dir / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: ours.get(k) for k in expected} == expected
    assert ours["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},  # the file's Q8_0
    }
    hf.setdefault("rope_theta", hf.get("rope_parameters", {}).get("rope_theta"))  # moved in transformers 5
    for key, value in expected.items():
        if isinstance(value, float):  # transformers keeps eps as the float32 it read: 9.999999747e-06
            assert np.float32(hf[key]) == np.float32(value), key
        else:
            assert hf[key] == value, key


# Text that stresses the byte-level BPE: unicode, digits, whitespace runs, specials.
TEXTS = [
    "Hello, world!",
    "  two leading spaces, trailing   ",
    "tabs\tand\t\tnew\nlines\n\n\n  indented",
    "Numbers: 0 7 42 1234567 3.14159 -2e10 1,000,000 2024-11-30",
    "unicode: héllo wörld — naïve café Ελληνικά русский 日本語のテキスト 한국어",
    "emoji 🤖🚀👩‍👩‍👧 and \u00a0nbsp \u200b zero-width",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>a/b<file_sep>c.py<jupyter_code>x=1",
    "<|im_start|> not quite <|im_start <|im_end|>>",
    "def f(x):\n    return {'a': x**2}  # it's, don't, we'll, I'M",
    "Ġ Ċ literal byte-alphabet characters",
    "",
]


@pytest.mark.real
def test_real_tokenizer_encodes_like_transformers(smollm2):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    _, mlx_dir, hf_dir = smollm2
    ours = Tokenizer.from_file(str(mlx_dir / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(str(hf_dir))  # transformers' reading of the GGUF, saved
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.get_vocab() == ref.get_vocab()
    special = {t.content for t in ours.get_added_tokens_decoder().values() if t.special}
    assert special == {t.content for t in ref.backend_tokenizer.get_added_tokens_decoder().values() if t.special}
    assert len(special) == 17

    tok_config = json.loads((mlx_dir / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == ref.chat_template
    assert (tok_config["bos_token"], tok_config["eos_token"]) == (ref.bos_token, ref.eos_token)
    assert tok_config["add_bos_token"] is False


@pytest.mark.real
def test_real_import_is_loadable_by_transformers_tokenizer(smollm2):
    """tokenizer_config.json is standard enough for AutoTokenizer, chat template included."""
    from transformers import AutoTokenizer

    _, mlx_dir, hf_dir = smollm2
    ours = AutoTokenizer.from_pretrained(str(mlx_dir))
    ref = AutoTokenizer.from_pretrained(str(hf_dir))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    a = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert a == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours(a).input_ids == ref(a).input_ids
