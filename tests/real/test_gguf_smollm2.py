"""import_gguf on the real SmolLM2-135M-Instruct Q4_1 file: against the ``gguf`` package's
reference dequantizer and against transformers' own reading of the same file."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402
from gguf_tiny import (  # noqa: E402
    dequantized,
    hf_order,
)

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
