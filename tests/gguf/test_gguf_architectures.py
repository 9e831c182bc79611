"""qwen3, qwen3moe and gpt-oss GGUF files written from tiny random transformers models the way
llama.cpp's converter writes them, against the file's values and transformers."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from gguf_tiny import (  # noqa: E402
    MERGES,
    SPECIALS,
    byte_alphabet,
    dequantized,
    finish,
    leftovers,
    sentencepiece_vocab,
    write_tiny_gguf,
)

from mlxinfer.errors import TokenizerError, WeightsError  # noqa: E402
from mlxinfer.gguf import import_gguf  # noqa: E402
from mlxinfer.loading.convert import convert  # noqa: E402


@pytest.fixture(scope="module")
def spm_vocab(tmp_path_factory):
    return sentencepiece_vocab(tmp_path_factory.mktemp("spm"))


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
