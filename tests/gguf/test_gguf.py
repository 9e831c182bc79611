"""import_gguf on a tiny synthetic llama GGUF written with the ``gguf`` package: every tensor
type bit-exact, the per-module record, ``--dtype``, its vocabulary, and the error paths."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
from gguf_tiny import (  # noqa: E402
    HIDDEN,
    N_HEADS,
    N_KV,
    TINY_SHAPES,
    TINY_TYPES,
    TOKENS,
    dequantized,
    hf_order,
    leftovers,
    write_tiny_gguf,
)

from mlxinfer.errors import MlxInferError, TokenizerError, WeightsError  # noqa: E402
from mlxinfer.gguf import import_gguf  # noqa: E402
from mlxinfer.loading.convert import convert  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf path, stored tensors, imported dir, report)"""
    root = tmp_path_factory.mktemp("tiny")
    stored = write_tiny_gguf(root / "tiny.gguf")
    report = import_gguf(root / "tiny.gguf", root / "model")
    return root / "tiny.gguf", stored, root / "model", report


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
