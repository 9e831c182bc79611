"""import_gguf: GGUF (llama, Q4_0/Q4_1/Q8_0/F16/BF16/F32, byte-level BPE) -> model directory.

Two kinds of evidence:
  * a tiny synthetic GGUF written with the ``gguf`` package, covering every tensor
    type and the error paths in milliseconds;
  * the real SmolLM2-135M-Instruct Q4_1 file, against the ``gguf`` package's
    reference dequantizer and against transformers' own reading of the same file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from mlxinfer.errors import MlxInferError, TokenizerError, WeightsError  # noqa: E402
from mlxinfer.gguf import import_gguf  # noqa: E402
from mlxinfer.loading.convert import convert  # noqa: E402

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
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        2,
        1,
        32,
    )


def _file_values(stored, name):
    """The file's values of a tiny tensor as transformers' gguf reader gives them, in HF row order."""
    data, ggml_type = stored[name]
    ref = dequantize(data, ggml_type).astype(np.float32)
    if name == "blk.0.attn_q":
        return hf_order(ref, N_HEADS)
    return hf_order(ref, N_KV) if name == "blk.0.attn_k" else ref


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtype_import_dequantizes_every_tensor(tiny, tmp_path, dtype):
    """``convert x.gguf --dtype D``: every tensor, whatever its type, is the file's value rounded to D
    (float32: exactly the file's), and the report says how far each is from the file."""
    gguf_path, stored, _, _ = tiny
    report = convert(gguf_path, tmp_path / "out", dtype=dtype)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == dtype and "quantization" not in config
    weights = mx.load(str(tmp_path / "out" / "model.safetensors"))
    target = getattr(mx, dtype)
    for module, (name, _) in TINY_TYPES.items():
        ref = _file_values(stored, name)
        w = weights[f"{module}.weight"]
        rounded = np.array(mx.array(ref).astype(target).astype(mx.float32))
        assert w.dtype == target, module
        np.testing.assert_array_equal(np.array(w.astype(mx.float32)), rounded, module)
        loss = report["loss"][f"{module}.weight"]
        assert loss["dtype"] == dtype and loss["max_abs"] == np.abs(rounded - ref).max(), (
            module,
            loss,
        )
        assert loss["max_abs"] == 0 or dtype != "float32"
    assert len(report["loss"]) == len(TINY_TYPES) + (
        3 if dtype != "float32" else 0
    )  # + the f32 norms


def test_dtype_import_with_q_quantizes_like_a_hf_checkpoint(tiny, tmp_path):
    """``--dtype float32 -q``: the file's float values quantized as ``convert -q`` quantizes a
    Hugging Face checkpoint: the same record, and each weight exactly ``mx.quantize`` of its value."""
    from mlxinfer.loading.loader import load_model
    from mlxinfer.quant.transform import quantize_model

    gguf_path, stored, _, _ = tiny
    report = convert(
        gguf_path, tmp_path / "q", dtype="float32", quantize=True, bits=4, group_size=32
    )
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    plain, _ = load_model(convert(gguf_path, tmp_path / "f32", dtype="float32")["path"], dtype=None)
    assert config["quantization"] == quantize_model(plain, bits=4, group_size=32)
    weights = mx.load(str(tmp_path / "q" / "model.safetensors"))
    for module, (name, _) in TINY_TYPES.items():
        expected = mx.quantize(mx.array(_file_values(stored, name)), group_size=32, bits=4)
        for key, value in zip(("weight", "scales", "biases"), expected):
            np.testing.assert_array_equal(
                np.array(weights[f"{module}.{key}"]), np.array(value), f"{module}.{key}"
            )
        assert report["loss"][f"{module}.weight"]["bits"] == 4
    model, _ = load_model(tmp_path / "q", dtype=None)
    ids = mx.array([[1, 5, 9, 3, 7]])
    np.testing.assert_allclose(
        np.array(model(ids)), np.array(plain(ids)), atol=1e-4
    )  # plain: quantized above


def test_tiny_tokenizer_keeps_specials_whole_and_adds_bos_flag(tiny):
    from tokenizers import Tokenizer

    _, _, model_dir, _ = tiny
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode("<|im_start|>the the<|im_end|>", add_special_tokens=False).ids
    assert [TOKENS[i] for i in ids] == ["<|im_start|>", "t", "he", "Ġthe", "<|im_end|>"]
    assert tok.decode(ids, skip_special_tokens=True) == "the the"
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is True
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_config["chat_template"] == "{{ messages[0]['content'] }}"


def test_tiny_tokenizer_adds_bos_like_transformers(tiny):
    """add_bos_token in the file: transformers' tokenizer for it puts BOS first, and so do we."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    src, _, model_dir, _ = tiny
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    for text in ["the the", "<|im_start|>the<|im_end|>", ""]:
        assert ours.encode(text).ids == ref(text).input_ids, text
    assert ours.encode("the").ids[0] == 1


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
    for cut, words in [
        (len(data) - 100, "truncated GGUF: tensor"),
        (300, "truncated GGUF header"),
        (2, "magic"),
    ]:
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
    q2k = np.zeros((2, 84), np.uint8)  # two Q2_K blocks of 256 weights (Q6_K is supported since)
    write_tiny_gguf(tmp_path / "k.gguf", extra_tensors=[("blk.0.extra.weight", q2k, T.Q2_K)])
    with pytest.raises(WeightsError, match="tensor blk.0.extra.weight has unsupported type Q2_K"):
        import_gguf(tmp_path / "k.gguf", tmp_path / "out")
    assert leftovers(tmp_path, "out") == []


def test_unknown_vocabulary_is_refused(tmp_path):
    write_tiny_gguf(
        tmp_path / "t5.gguf", tokenizer_model="t5"
    )  # (SentencePiece, "llama", is supported since)
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model is 't5'; supported: 'gpt2'"):
        import_gguf(tmp_path / "t5.gguf", tmp_path / "out")
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
        (
            "blk.11.attn_q.weight",
            "model.layers.11.self_attn.q_proj",
            9,
        ),  # Q4_1, permuted by 9 heads
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
        np.testing.assert_array_equal(
            dequantized(ours, module, quant), np.array(hf[f"{module}.weight"]), module
        )


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
    hf.setdefault(
        "rope_theta", hf.get("rope_parameters", {}).get("rope_theta")
    )  # moved in transformers 5
    for key, value in expected.items():
        if isinstance(
            value, float
        ):  # transformers keeps eps as the float32 it read: 9.999999747e-06
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
    assert special == {
        t.content for t in ref.backend_tokenizer.get_added_tokens_decoder().values() if t.special
    }
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


@pytest.fixture(scope="module")
def spm_vocab(tmp_path_factory):
    return sentencepiece_vocab(tmp_path_factory.mktemp("spm"))


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
    from mlxinfer.errors import TokenizerError
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


# ---------------------------------------------------------------------------
# the real Gemma-3-270M Q4_K_M file (base model, not instruction-tuned)


@pytest.fixture(scope="module")
def gemma3():
    """(gguf path, our import) -- cached on disk."""
    from fixtures import gemma3_gguf_path, gemma3_mlx_dir

    return gemma3_gguf_path(), gemma3_mlx_dir()


@pytest.mark.real
def test_real_gemma3_weights_vs_gguf_reference(gemma3):
    """Exact types bit-identical; K-quant decoding bit-identical and the stored loss as reported."""
    import mlxinfer.gguf.quants as gq

    gguf_path, mlx_dir = gemma3
    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
    ours = mx.load(str(mlx_dir / "model.safetensors"))
    quant = json.loads((mlx_dir / "config.json").read_text())["quantization"]
    cases = {
        "token_embd.weight": ("model.embed_tokens", "Q8_0"),
        "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj", "Q5_0"),
        "blk.7.ffn_up.weight": ("model.layers.7.mlp.up_proj", "Q5_0"),
        "blk.4.attn_v.weight": ("model.layers.4.self_attn.v_proj", "Q8_0"),
        "blk.5.attn_output.weight": ("model.layers.5.self_attn.o_proj", "Q4_K"),
        "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj", "Q6_K"),
        "blk.2.ffn_down.weight": ("model.layers.2.mlp.down_proj", "Q4_K"),
    }
    for name, (module, type_name) in cases.items():
        t = tensors[name]
        assert t.tensor_type.name == type_name
        ref = dequantize(t.data, t.tensor_type)
        if type_name in ("Q4_K", "Q6_K"):  # our decoder on real blocks
            raw = np.asarray(t.data).reshape(-1).view(np.uint8)
            np.testing.assert_array_equal(gq.dequantize(raw, type_name, ref.shape), ref)
        if name == "token_embd.weight":  # 168M weights: compare a slice of rows
            ref = ref[:4096]
            stored = np.array(
                mx.dequantize(
                    ours[f"{module}.weight"][:4096],
                    ours[f"{module}.scales"][:4096].astype(mx.float32),
                    ours[f"{module}.biases"][:4096].astype(mx.float32),
                    group_size=32,
                    bits=8,
                )
            )
        else:
            stored = dequantized(ours, module, quant)
        if type_name in ("Q4_K", "Q6_K"):
            rel_rmse = np.sqrt(np.mean((stored - ref) ** 2) / np.mean(ref.astype(np.float64) ** 2))
            assert rel_rmse < (1e-3 if type_name == "Q4_K" else 1e-2), name
        else:
            np.testing.assert_array_equal(stored, ref, err_msg=name)
    for name in (
        "blk.4.attn_norm.weight",
        "blk.4.attn_q_norm.weight",
        "blk.9.post_ffw_norm.weight",
        "output_norm.weight",
    ):
        module = hf_gemma_norm(name)
        np.testing.assert_array_equal(
            np.array(ours[f"{module}.weight"]), tensors[name].data - np.float32(1)
        )


def hf_gemma_norm(name: str) -> str:
    from mlxinfer.gguf.arch import hf_module

    return hf_module("gemma3", Path("x"), name)[0]


@pytest.mark.real
def test_real_gemma3_config_and_kquant_formats(gemma3):
    _, mlx_dir = gemma3
    config = json.loads((mlx_dir / "config.json").read_text())
    expected = {
        "model_type": "gemma3_text",
        "hidden_size": 640,
        "num_hidden_layers": 18,
        "intermediate_size": 2048,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "sliding_window": 512,
        "query_pre_attn_scalar": 256,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    }
    assert {k: config.get(k) for k in expected} == expected
    assert (
        config["layer_types"].count("full_attention") == 3
        and config["layer_types"][5] == "full_attention"
    )
    q = config["quantization"]
    assert (q["bits"], q["group_size"]) == (5, 32)  # Q5_0, the file's most common type
    assert q["model.embed_tokens"]["bits"] == 8  # Q8_0
    assert q["model.layers.0.self_attn.o_proj"]["bits"] == 4  # Q4_K, codes kept
    assert q["model.layers.0.mlp.down_proj"]["bits"] == 8  # Q6_K -> 8-bit


@pytest.mark.real
def test_real_gemma3_tokenizer_encodes_like_transformers(gemma3):
    from fixtures import gemma3_hf_tokenizer_dir
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    _, mlx_dir = gemma3
    ours = Tokenizer.from_file(str(mlx_dir / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(str(gemma3_hf_tokenizer_dir()))
    texts = MULTILINGUAL + [
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "<bos><eos><pad><mask>[multimodal] <unused0>",
        "▁ literal, \u00a0nbsp, \u200b zero-width, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0001f9ec",
    ]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    assert ours.get_vocab() == ref.get_vocab()
    ours_added = {(t.content, t.special) for t in ours.get_added_tokens_decoder().values()}
    assert ours_added == {
        (t.content, t.special) for t in ref.backend_tokenizer.get_added_tokens_decoder().values()
    }


GEMMA3_PROMPTS = {
    "qa": "Question: What is the capital of France?\nAnswer:",
    "story": "Once upon a time",
}


@pytest.mark.real
def test_real_gemma3_greedy_output_matches_transformers(gemma3):
    """16 greedy tokens, plain completion and through the chat template, as transformers
    generates them from the same GGUF. (This is the base model: asked in chat form it echoes
    the question; completion prompts are where it is coherent.)"""
    from fixtures import gemma3_reference

    import mlxinfer
    from mlxinfer.generation import generate_step

    _, mlx_dir = gemma3
    # float32 activations: on the CPU, MLX's float16 kernels are ~50x slower, and Gemma's
    # activations overflow float16 anyway; the float16 scales widen exactly.
    model, tok = mlxinfer.load(mlx_dir, dtype=mx.float32)
    assert not tok.has_chat_template  # a base model: the file carries none
    tok.set_chat_template("gemma")
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    assert (
        chat
        == "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    )
    prompts = {name: tok.encode(text) for name, text in GEMMA3_PROMPTS.items()}
    prompts["chat"] = tok.encode(chat, add_special_tokens=False)
    reference = gemma3_reference(prompts, 16)
    for name, ids in prompts.items():
        ours = [t for t, _ in generate_step(ids, model, max_tokens=16)]
        assert ours[: len(reference[name])] == reference[name], (name, tok.decode(ours))
    answer = mlxinfer.generate(model, tok, GEMMA3_PROMPTS["qa"], max_tokens=4, chat_template=False)
    assert answer.strip().startswith("Paris")


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="~40 s on 2 cores, outside the suite's 15 minutes (test_families.py checks the clip on "
    "a tiny Gemma): set MLXINFER_SLOW=1 to run",
)
def test_real_gemma3_runs_in_float16_as_stored(gemma3):
    """Loaded as stored (float16 scales, so float16 activations), Gemma's residual stream would
    overflow to inf and NaN; the float16 path clips it and stays close to float32. (Hidden states
    only: float16 quantized matmuls over the 262k-row head are very slow on the CPU backend.)"""
    from mlxinfer.loading.loader import load_model
    from mlxinfer.tokenization import Tokenizer as OurTokenizer

    _, mlx_dir = gemma3
    ids = mx.array([OurTokenizer.from_dir(mlx_dir).encode("The capital of France is")])
    f16, _ = load_model(mlx_dir, dtype=None)  # as stored
    f32, _ = load_model(mlx_dir, dtype=mx.float32)
    h16 = np.array(f16.model(ids).astype(mx.float32))
    h32 = np.array(f32.model(ids))
    assert f16.model(ids).dtype == mx.float16 and np.isfinite(h16).all()
    # The BOS position's huge activations are the clipped ones; the last position, whose
    # hidden state picks the next token, stays close (float16 rounding over 18 layers).
    last16, last32 = h16[0, -1], h32[0, -1]
    assert np.linalg.norm(last16 - last32) / np.linalg.norm(last32) < 0.15  # measured: 0.09


TRANSLATE = "Translate to French: good morning, my friend."


@pytest.mark.real
def test_real_gemma3_base_model_gets_the_raw_prompt_from_the_cli(gemma3):
    """The base model's file has no chat template, so `mlxinfer generate` with default flags sends
    the raw prompt: its output is transformers' greedy continuation of that prompt (it once got
    Gemma's turn format and answered "… mendatang …")."""
    import subprocess
    import sys

    from fixtures import gemma3_reference, reference_prompt

    from mlxinfer.tokenization import Tokenizer as OurTokenizer

    _, mlx_dir = gemma3
    ids = OurTokenizer.from_dir(mlx_dir).encode(TRANSLATE)
    gemma3_reference({"translate": ids}, 16)  # transformers' ids for the prompt are ours
    expected = reference_prompt("gemma3", 16, text=TRANSLATE)["texts"]["16"]  # decoded by it
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxinfer",
            "generate",
            "-m",
            str(mlx_dir),
            "-p",
            TRANSLATE,
            "-n",
            "16",
            "-v",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    assert "no chat template, so the prompt goes to the model as raw text" in out.stderr


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="~30 s on 2 cores, outside the suite's 15 minutes (the exact dequantization is checked "
    "by test_real_gemma3_weights_vs_gguf_reference, the greedy tokens of the import by "
    "test_real_gemma3_greedy_output_matches_transformers): set MLXINFER_SLOW=1 to run",
)
def test_real_gemma3_float32_import_matches_transformers(gemma3, tmp_path):
    """`convert gemma-3-270m-q4_k_m.gguf --dtype float32`: every tensor (Q5_0, Q8_0, Q4_K, Q6_K)
    dequantized exactly, so greedy decoding of raw prompts is transformers' on the same GGUF."""
    from fixtures import gemma3_reference

    import mlxinfer
    from mlxinfer.generation import generate_step

    gguf_path, _ = gemma3
    report = convert(gguf_path, tmp_path / "f32", dtype="float32")
    assert {v["type"] for v in report["loss"].values()} >= {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    assert max(v["max_abs"] for v in report["loss"].values()) == 0
    model, tok = mlxinfer.load(tmp_path / "f32")
    prompts = {
        name: tok.encode(text) for name, text in {**GEMMA3_PROMPTS, "translate": TRANSLATE}.items()
    }
    reference = gemma3_reference(prompts, 16)  # committed: tests/fixtures/reference
    for name, ids in prompts.items():  # 10 of them: the float32 262k-row head is slow here
        ours = [t for t, _ in generate_step(ids, model, max_tokens=10)]
        n = min(10, len(reference[name]))
        assert ours[:n] == reference[name][:n], (name, tok.decode(ours))


# ---------------------------------------------------------------------------
# qwen3, qwen3moe and gpt-oss: tiny synthetic files written from a tiny random transformers
# model the way llama.cpp's converter writes them (names, gpt-oss's de-interleaved experts,
# MXFP4), checked against the file's values and against transformers running the source
# checkpoint with those values. (transformers' own GGUF reader cannot serve as the reference
# here: it reads neither qwen3's attention.key_length nor qwen3moe's
# expert_feed_forward_length, and leaves gpt-oss's stacked experts unmapped.)

BPE_MERGES = MERGES + ["1 2", "12 3", "o W"]
BPE_TOKENS = SPECIALS + byte_alphabet() + ["Ġt", "he", "Ġthe", "12", "123", "oW"]
# "12345": qwen2 splits digits singly, gpt-4o in threes, GPT-2 not at all; "HelloWorld":
# gpt-4o splits before a capital, so "oW" never merges there.
BPE_TEXTS = [
    "the the 12345 HelloWorld",
    "<|im_start|>user\nthe 123<|im_end|>",
    "don't  stop\n\n 1234567 naïve 東京 🙂",
    "",
]
MOE_IDS = [3, 17, 99, 5, 240, 8, 8, 61, 130, 2, 77, 19, 200, 45, 1, 33, 150, 9, 12, 255]

# (arch, make_tiny overrides, per-file tensor types: GGUF tensor-name part -> ggml type)
GGUF_ARCHS = {
    "qwen3": dict(
        model_type="qwen3",
        hf=dict(head_dim=32, rope_theta=1e6),  # head_dim != hidden / heads, as in every Qwen3
        types={"attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q5_1, "attn_output": T.F16,
               "ffn_gate": T.Q4_1, "ffn_up": T.BF16, "ffn_down": T.Q5_0, "token_embd": T.Q8_0,
               "output": T.F16},
    ),
    "qwen3moe": dict(
        model_type="qwen3_moe",
        hf=dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True),  # llama.cpp always renormalises qwen3moe's top-k
        # layer 1's gate and up differ in type (Q4_1 vs F16): stored fused as float32
        types={"attn_q": T.Q8_0, "attn_k": T.F16, "attn_v": T.Q4_0, "attn_output": T.Q5_0,
               "ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q8_0, "ffn_down_exps": T.Q4_0,
               "blk.1.ffn_gate_exps": T.Q4_1, "blk.1.ffn_up_exps": T.F16, "token_embd": T.F16,
               "output": T.Q8_0},
    ),
    "gpt-oss": dict(
        model_type="gpt_oss",
        hf=dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                sliding_window=4),
        types={"attn_q": T.Q8_0, "attn_k": T.F16, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
               "ffn_gate_exps": T.MXFP4, "ffn_up_exps": T.MXFP4, "ffn_down_exps": T.MXFP4,
               "token_embd": T.Q8_0, "output": T.F16},
    ),
}  # fmt: skip


def hf_to_gguf(arch: str, state: dict) -> dict[str, np.ndarray]:
    """An HF state dict in llama.cpp's names and layout (float32)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm" if arch == "gpt-oss" else "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.router": "ffn_gate_inp",
    }  # fmt: skip
    out = {}
    for key, value in state.items():
        a = value.float().numpy()
        if key in top:
            out[top[key]] = a
            continue
        _, _, i, rest = key.split(".", 3)
        blk = f"blk.{i}"
        if rest == "self_attn.sinks":
            out[f"{blk}.attn_sinks.weight"] = a
        elif rest == "mlp.experts.gate_up_proj" and arch == "gpt-oss":  # (E, H, 2I) interleaved
            a = a.swapaxes(1, 2)
            out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = (
                a[:, ::2],
                a[:, 1::2],
            )
        elif rest == "mlp.experts.gate_up_proj_bias":  # (E, 2I) interleaved
            out[f"{blk}.ffn_gate_exps.bias"], out[f"{blk}.ffn_up_exps.bias"] = a[:, ::2], a[:, 1::2]
        elif rest == "mlp.experts.gate_up_proj":  # qwen3moe: (E, 2I, H), [gate; up]
            half = a.shape[1] // 2
            out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = (
                a[:, :half],
                a[:, half:],
            )
        elif rest == "mlp.experts.down_proj":  # gpt-oss (E, I, H); qwen3moe (E, H, I)
            out[f"{blk}.ffn_down_exps.weight"] = a.swapaxes(1, 2) if arch == "gpt-oss" else a
        elif rest == "mlp.experts.down_proj_bias":
            out[f"{blk}.ffn_down_exps.bias"] = a
        else:
            module, kind = rest.rsplit(".", 1)
            out[f"{blk}.{layer[module]}.{kind}"] = a
    return {k: np.ascontiguousarray(v) for k, v in out.items()}  # fmt: skip


def gguf_to_hf(arch: str, values: dict[str, np.ndarray], like: dict) -> dict:
    """Inverse of hf_to_gguf: the file's (dequantized) values as the HF model's state dict."""
    import torch

    out = {}
    for key, value in like.items():  # where each HF element went: send 1..n through, others 0
        marked = {k: torch.zeros_like(v) for k, v in like.items()}
        marked[key] = torch.arange(1, value.numel() + 1, dtype=torch.float32).reshape(value.shape)
        flat = np.zeros(value.numel(), np.float32)
        for name, where in hf_to_gguf(arch, marked).items():
            hit = where > 0
            flat[where[hit].astype(np.int64) - 1] = values[name][hit]
        out[key] = torch.from_numpy(flat.reshape(value.shape))
    return out


def gguf_type(types: dict, name: str):
    """The ggml type a tiny file stores a tensor in: per-layer entry, per-name entry, or F32."""
    base = name.rsplit(".", 1)[0]
    if name.endswith(".weight") and base in types:
        return types[base]
    part = base.split(".")[-1]
    return types.get(part, T.F32) if name.endswith(".weight") else T.F32


def write_arch_gguf(path, arch: str, spec: dict, state: dict, config) -> dict:
    """A GGUF of ``state`` as llama.cpp writes ``arch``; returns {name: (data, type)}."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if arch == "qwen3moe":
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "gpt-oss":
        w.add_expert_count(config.num_local_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.intermediate_size)
        w.add_sliding_window(config.sliding_window)
        rope = config.rope_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o" if arch == "gpt-oss" else "qwen2")
    w.add_token_list(BPE_TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(BPE_TOKENS) - len(SPECIALS)))
    w.add_token_merges(BPE_MERGES)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    stored = {}
    for name, x in hf_to_gguf(arch, state).items():
        ggml_type = gguf_type(spec["types"], name)
        data = x if ggml_type == T.F32 else quantize(x, ggml_type)
        w.add_tensor(name, data, raw_dtype=None if ggml_type == T.F32 else ggml_type)
        stored[name] = (data, ggml_type)
    finish(w)
    return stored


@pytest.fixture(scope="module", params=sorted(GGUF_ARCHS))
def arch_tiny(request, tmp_path_factory):
    """(arch, spec, stored tensors, our import dir, HF source model with the file's values)"""
    from hf_models import make_tiny

    arch, spec = request.param, GGUF_ARCHS[request.param]
    root = tmp_path_factory.mktemp(arch)
    _, hf = make_tiny(root / "hf", spec["model_type"], perturb_vectors=True,
                      vocab_size=len(BPE_TOKENS), **spec["hf"])  # fmt: skip
    import torch

    with torch.no_grad():  # sinks far from 0, so that they count
        for layer in hf.model.layers:
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.normal_(0, 1.5)
    state = hf.state_dict()
    stored = write_arch_gguf(root / f"{arch}.gguf", arch, spec, state, hf.config)
    import_gguf(root / f"{arch}.gguf", root / "ours")
    values = {n: dequantize(d, t).astype(np.float32) for n, (d, t) in stored.items()}
    hf.load_state_dict(gguf_to_hf(arch, values, state))
    return arch, spec, stored, root, hf


def stored_values(weights: dict, key: str, quant: dict | None) -> np.ndarray:
    """One of our tensors as float32: quantized layers dequantized (scales widened first)."""
    module, kind = key.rsplit(".", 1)
    if kind != "weight" or f"{module}.scales" not in weights:
        return np.array(weights[key].astype(mx.float32))
    cfg = quant.get(module, quant)
    if cfg["mode"] == "mxfp4":
        w = mx.dequantize(weights[key], weights[f"{module}.scales"], None, group_size=32, bits=4,
                          mode="mxfp4", dtype=mx.float32)  # fmt: skip
        return np.array(w)
    return dequantized(weights, module, quant)


def expected_ours(arch: str, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The file's values under our names: gate and up experts stacked [gate; up]."""
    from mlxinfer.gguf.arch import hf_module

    out, halves = {}, {}
    for name, a in values.items():
        module, kind = hf_module(arch, Path("x"), name)
        part = {"ffn_gate_exps": 0, "ffn_up_exps": 1}.get(name.split(".")[-2])
        if part is None:
            out[f"{module}.{kind}"] = a
        else:
            halves.setdefault(f"{module}.{kind}", {})[part] = a
    for key, h in halves.items():
        out[key] = np.concatenate([h[0], h[1]], axis=1)
    return out


def test_arch_weights_equal_the_files_values(arch_tiny):
    """Every tensor, quantized or not, is the file's value bit for bit (gguf's dequantizer),
    gate and up experts fused; the quantization record says which type each module kept."""
    arch, _, stored, root, _ = arch_tiny
    ours = mx.load(str(root / "ours" / "model.safetensors"))
    quant = json.loads((root / "ours" / "config.json").read_text()).get("quantization")
    values = {n: dequantize(d, t).astype(np.float32) for n, (d, t) in stored.items()}
    expected = expected_ours(arch, values)
    assert {k for k in ours if not k.endswith((".scales", ".biases"))} == set(expected)
    for key, ref in expected.items():
        np.testing.assert_array_equal(stored_values(ours, key, quant), ref, err_msg=key)


def test_arch_quantized_types_keep_their_codes(arch_tiny):
    arch, _, _, root, _ = arch_tiny
    quant = json.loads((root / "ours" / "config.json").read_text())["quantization"]
    ours = mx.load(str(root / "ours" / "model.safetensors"))
    experts = "model.layers.0.mlp.experts"
    if arch == "gpt-oss":  # MXFP4 experts: MLX mxfp4, uint8 exponents, no biases
        mxfp4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        assert quant[f"{experts}.gate_up_proj"] == quant[f"{experts}.down_proj"] == mxfp4
        assert ours[f"{experts}.gate_up_proj.scales"].dtype == mx.uint8
        assert f"{experts}.gate_up_proj.biases" not in ours
        assert ours[f"{experts}.gate_up_proj.weight"].shape == (4, 64, 64 * 4 // 32)
        assert ours[f"{experts}.gate_up_proj.bias"].shape == (4, 64)
        assert quant.get("model.layers.0.mlp.router", False) is False
    elif arch == "qwen3moe":
        q8 = {"group_size": 32, "bits": 8, "mode": "affine"}
        top = {k: quant[k] for k in ("group_size", "bits", "mode")}
        assert quant.get(f"{experts}.gate_up_proj", top) == q8  # Q8_0 gate and up, fused
        assert ours[f"{experts}.gate_up_proj.weight"].shape == (4, 64, 64 * 8 // 32)
        # layer 1: Q4_1 gate beside an F16 up: no common form, both exact in float32
        assert quant["model.layers.1.mlp.experts.gate_up_proj"] is False
        assert ours["model.layers.1.mlp.experts.gate_up_proj.weight"].dtype == mx.float32
    else:
        assert quant["model.layers.0.self_attn.v_proj"] == {
            "group_size": 32, "bits": 5, "mode": "affine"
        }  # fmt: skip
        assert ours["model.layers.0.mlp.up_proj.weight"].dtype == mx.bfloat16


def test_arch_config_matches_the_source(arch_tiny):
    from mlxinfer.models.config import normalize_rope

    arch, spec, _, root, hf = arch_tiny
    ours = json.loads((root / "ours" / "config.json").read_text())
    src = hf.config.to_dict()
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
            "attention_bias"]  # fmt: skip
    keys += {
        "qwen3": ["intermediate_size"],
        "qwen3moe": ["intermediate_size", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "norm_topk_prob"],
        "gpt-oss": ["intermediate_size", "num_local_experts", "num_experts_per_tok",
                    "sliding_window", "layer_types"],
    }[arch]  # fmt: skip
    assert ours["model_type"] == spec["model_type"]
    src.setdefault("num_experts", src.get("num_local_experts"))  # transformers 5's name
    for key in keys:
        assert ours[key] == src[key], key
    assert np.float32(ours["rms_norm_eps"]) == np.float32(src["rms_norm_eps"])
    rope = normalize_rope(src)
    assert ours["rope_theta"] == rope["rope_theta"]
    assert (ours.get("rope_scaling") or None) == rope["rope_scaling"]
    assert (ours["eos_token_id"], ours["pad_token_id"]) == (2, 0)


def test_arch_logits_match_transformers(arch_tiny):
    """f32 logits within 1e-3 of transformers running the source model with the file's values
    (past gpt-oss's sliding window of 4)."""
    import torch

    from mlxinfer.loading.loader import load_model

    _, _, _, root, hf = arch_tiny
    model, _ = load_model(root / "ours", dtype=mx.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([MOE_IDS])).logits[0].numpy()
    assert np.abs(np.array(model(mx.array([MOE_IDS]))[0]) - expected).max() <= 1e-3


def test_arch_tokenizer_encodes_like_transformers(arch_tiny):
    """Qwen's and GPT-4o's split regexes, as transformers' reading of the same file."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    arch, _, _, root, _ = arch_tiny
    ours = Tokenizer.from_file(str(root / "ours" / "tokenizer.json"))
    # (not AutoTokenizer: transformers' gpt-oss config reader fails on rope.scaling.factor)
    ref = PreTrainedTokenizerFast.from_pretrained(str(root), gguf_file=f"{arch}.gguf")
    for text in BPE_TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    pieces = [BPE_TOKENS[i] for i in ours.encode("12345 HelloWorld").ids]
    assert pieces == (
        ["123", "4", "5", "Ġ", "H", "e", "l", "l", "o", "W", "o", "r", "l", "d"]
        if arch == "gpt-oss"
        else ["1", "2", "3", "4", "5", "Ġ", "H", "e", "l", "l", "oW", "o", "r", "l", "d"]
    )


def test_arch_float32_import_is_the_files_values(arch_tiny, tmp_path):
    """``--dtype float32``: every tensor (MXFP4 and stacked experts included) exactly the file's
    value, gate and up fused the same way."""
    arch, _, stored, root, _ = arch_tiny
    report = convert(root / f"{arch}.gguf", tmp_path / "f32", dtype="float32")
    ours = mx.load(str(tmp_path / "f32" / "model.safetensors"))
    values = {n: dequantize(d, t).astype(np.float32) for n, (d, t) in stored.items()}
    expected = expected_ours(arch, values)
    assert set(ours) == set(expected)
    for key, ref in expected.items():
        assert ours[key].dtype == mx.float32, key
        np.testing.assert_array_equal(np.array(ours[key]), ref, err_msg=key)
    assert max(v["max_abs"] for v in report["loss"].values()) == 0


def test_mxfp4_maps_onto_mlx_bit_exactly_for_every_exponent():
    """MXFP4 blocks with every exponent 0-254 and random codes: MLX's mxfp4 mode on our packing
    gives gguf's dequantized values, and so does our own decoder."""
    import mlxinfer.gguf.quants as gq

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (255, 2, 17), dtype=np.uint8)  # 255 rows of 64 weights
    blocks[:, :, 0] = np.arange(255, dtype=np.uint8)[:, None]
    raw = blocks.reshape(255, -1)
    with np.errstate(over="ignore"):  # the top exponents times 6 overflow to inf, in both
        ref = dequantize(raw, T.MXFP4)
        decoded = gq.dequantize(raw.reshape(-1), "MXFP4", (255, 64))
    a = gq.to_mxfp4(raw.reshape(-1), 255, 64)
    ours = mx.dequantize(mx.array(a.weight), mx.array(a.scales), None, group_size=32, bits=4,
                         mode="mxfp4", dtype=mx.float32)  # fmt: skip
    np.testing.assert_array_equal(np.array(ours), ref)
    np.testing.assert_array_equal(decoded, ref)


def test_expert_half_without_its_partner_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3moe")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 64),
                       ("feed_forward_length", 64), ("attention.head_count", 2),
                       ("expert_count", 2), ("expert_used_count", 1),
                       ("expert_feed_forward_length", 32)]:  # fmt: skip
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(BPE_TOKENS)
    w.add_token_merges(BPE_MERGES)
    w.add_tensor("token_embd.weight", np.zeros((len(BPE_TOKENS), 64), np.float32))
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 32, 64), np.float32))
    finish(w)
    with pytest.raises(
        WeightsError, match="tensor blk.0.ffn_gate_exps.weight has no blk.0.ffn_up_exps.weight"
    ) as e:
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert str(tmp_path / "m.gguf") in str(e.value)
    assert leftovers(tmp_path, "out") == []


def test_unknown_pre_tokenizer_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "p.gguf")
    data = (tmp_path / "p.gguf").read_bytes().replace(b"gpt-2", b"llama", 1)  # same length
    (tmp_path / "p.gguf").write_bytes(data)
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre is 'llama'; supported: 'gpt-2'"):
        import_gguf(tmp_path / "p.gguf", tmp_path / "out")


def test_stacked_kquant_experts_keep_their_codes_per_expert():
    """A (E, out, in) Q4_K expert tensor (as Qwen3-30B-A3B's Q4_K_M stores ffn_gate_exps)
    keeps its codes as (E, out, in*4/32) MLX groups; only scales and biases round to float16."""
    from mlxinfer.gguf.container import GGUFTensor
    from mlxinfer.gguf.tensors import convert_tensor

    rng = np.random.default_rng(0)  # (gguf cannot quantize to Q4_K: random blocks, sane d/dmin)
    blocks = rng.integers(0, 256, (3 * 4, 144), dtype=np.uint8)
    blocks[:, 0:4] = rng.uniform(1e-3, 1e-2, (3 * 4, 2)).astype(np.float16).view(np.uint8)
    data = blocks.reshape(3, 4, 144)
    buf = data.tobytes()
    t = GGUFTensor("blk.0.ffn_gate_exps.weight", (3, 4, 256), "Q4_K", 0, len(buf))
    _, a, loss = convert_tensor(buf, t, None)
    assert (a.weight.shape, a.scales.shape, a.biases.shape) == ((3, 4, 32), (3, 4, 8), (3, 4, 8))
    assert loss["codes_kept"] and loss["rel_rmse"] < 1e-3
    values = np.array(mx.dequantize(mx.array(a.weight), mx.array(a.scales.astype(np.float32)),
                                    mx.array(a.biases.astype(np.float32)), group_size=32, bits=4))  # fmt: skip
    ref = dequantize(data, T.Q4_K)
    assert values.shape == ref.shape == (3, 4, 256)
    assert np.abs(values - ref).max() <= loss["max_abs"] + 1e-7
    assert np.sqrt(np.mean((values - ref) ** 2) / np.mean(ref**2)) < 1e-3
