"""GGUF tensor types: our decoders and the MLX form each type is stored in.

Spec:
  * every supported type decodes bit-identically to ``gguf.quants.dequantize``;
  * exact types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are stored as MLX affine groups of 32
    whose dequantized values are bit-identical to the reference (no second rounding);
  * K-quants: Q4_K/Q5_K keep their codes (4/5-bit, group 32), Q6_K is re-quantized to
    8-bit group 32; the import reports each tensor's loss, and the loss is what it says;
  * IQ4_NL/IQ4_XS are stored as MLX 8-bit group 32 holding their table's levels: IQ4_NL
    bit-identical, IQ4_XS within its float16 scale rounding (exact when the scales fit);
  * ``requantize=(bits, group)`` (``convert -q`` on a GGUF) re-quantizes only the K-quants
    and IQ4 types.
Files are written with the ``gguf`` package's GGUFWriter; exact types are made with
``gguf.quants.quantize``, K-quant blocks (which the package cannot encode) from random
bytes with sane float16 scales -- any such bytes are a valid block.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from gguf_tiny import byte_alphabet, dequantized, hf_order, llama_cpp_permute  # noqa: E402

import mlxinfer.gguf.quants as gq  # noqa: E402
from mlxinfer.errors import WeightsError  # noqa: E402
from mlxinfer.gguf import import_gguf  # noqa: E402
from mlxinfer.loading.convert import convert  # noqa: E402

EXACT = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
KQUANTS = ["Q4_K", "Q5_K", "Q6_K"]


def kquant_blocks(
    name: str, rows: int, cols: int, seed: int = 0, power_of_two_scales: bool = False
) -> np.ndarray:
    """Random K-quant blocks for a (rows, cols) matrix, as (rows, bytes per row) uint8.

    Codes and sub-block scales are random bytes; the float16 super-scales are set to
    plausible weights' magnitudes (or powers of two, which make d·sc exact in float16).
    """
    rng = np.random.default_rng(seed)
    t = gq.TYPES_BY_NAME[name]
    n = rows * cols // gq.SUPER
    blocks = rng.integers(0, 256, size=(n, t.nbytes), dtype=np.uint8)

    def scales():
        if power_of_two_scales:
            return np.float16(2.0 ** -rng.integers(8, 12, n))
        return np.float16(rng.uniform(2e-4, 2e-3, n))

    for start in (0, 2) if name in ("Q4_K", "Q5_K") else (208,):
        blocks[:, start : start + 2] = scales().view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


# ---------------------------------------------------------------------------
# decoders


@pytest.mark.parametrize("name", EXACT + ["F16", "BF16", "F32"])
def test_decoder_bit_identical_to_gguf_on_quantized_data(name):
    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    data = quantize(x, T[name])
    ref = dequantize(data, T[name])
    ours = gq.dequantize(data.view(np.uint8).reshape(-1), name, ref.shape)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("name", KQUANTS)
def test_kquant_decoder_bit_identical_to_gguf_on_arbitrary_blocks(name):
    blocks = kquant_blocks(name, 8, 1024)
    ref = dequantize(blocks, T[name])
    ours = gq.dequantize(blocks.reshape(-1), name, ref.shape)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", EXACT)
def test_exact_type_maps_onto_mlx_affine_without_rounding(name):
    x = np.random.default_rng(2).standard_normal((16, 128)).astype(np.float32) * 0.02
    data = quantize(x, T[name])
    affine = gq.to_affine(data.reshape(-1), name, 16, 128)
    assert (affine.bits, affine.group_size) == (gq.EXACT_BITS[name], 32)
    assert affine.scales.dtype == affine.biases.dtype == np.float16
    np.testing.assert_array_equal(gq.affine_values(affine), dequantize(data, T[name]))


def iq4_blocks(name: str, rows: int, cols: int, seed: int = 0, power_of_two: bool = False):
    """Random IQ4 blocks for a (rows, cols) matrix, (rows, bytes per row) uint8: random
    indices and sub-block scales, float16 ``d`` of plausible size (or a power of two, which
    makes IQ4_XS's ``d (ls - 32)`` exact in float16)."""
    rng = np.random.default_rng(seed)
    t = gq.TYPES_BY_NAME[name]
    n = rows * cols // t.block
    blocks = rng.integers(0, 256, size=(n, t.nbytes), dtype=np.uint8)
    d = 2.0 ** -rng.integers(12, 16, n) if power_of_two else rng.uniform(2e-5, 2e-4, n)
    blocks[:, 0:2] = np.float16(d).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", ["IQ4_NL", "IQ4_XS"])
def test_iq4_decoder_bit_identical_to_gguf_on_arbitrary_blocks(name):
    blocks = iq4_blocks(name, 8, 512)
    ref = dequantize(blocks, T[name])
    ours = gq.dequantize(blocks.reshape(-1), name, ref.shape)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("name,power_of_two", [("IQ4_NL", False), ("IQ4_XS", True)])
def test_iq4_maps_onto_mlx_8_bit_without_rounding(name, power_of_two):
    blocks = iq4_blocks(name, 4, 512, seed=3, power_of_two=power_of_two)
    affine = gq.codebook_to_affine(blocks.reshape(-1), name, 4, 512)
    assert (affine.bits, affine.group_size, affine.mode) == (8, 32, "affine")
    np.testing.assert_array_equal(gq.affine_values(affine), dequantize(blocks, T[name]))


def test_iq4_xs_scales_round_only_as_far_as_float16():
    """Any d: each group's scale d (ls - 32) is rounded once to float16, so every stored
    weight is within half a float16 ulp (2^-11 relative) of the file's."""
    blocks = iq4_blocks("IQ4_XS", 4, 512, seed=4)
    ref = dequantize(blocks, T["IQ4_XS"]).reshape(-1, 32)
    stored = gq.affine_values(gq.codebook_to_affine(blocks.reshape(-1), "IQ4_XS", 4, 512))
    err = np.abs(stored.reshape(-1, 32) - ref)
    bound = np.abs(ref).max(axis=1, keepdims=True) * 2.0**-11
    assert (err <= bound).all()
    assert err.max() > 0  # random scales do need more bits than float16 has


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_mlx_bit_order(bits):
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=(3, 128))
    packed = mx.array(gq.pack(codes, bits))
    ones, zeros = mx.ones((3, 4)), mx.zeros((3, 4))
    np.testing.assert_array_equal(
        np.array(mx.dequantize(packed, ones, zeros, group_size=32, bits=bits)), codes
    )


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_kquant_codes_are_kept_and_exact_when_scales_fit_float16(name):
    blocks = kquant_blocks(name, 4, 512, power_of_two_scales=True)
    affine = gq.kquant_to_affine(blocks.reshape(-1), name, 4, 512)
    assert (affine.bits, affine.group_size) == (gq.KQUANT_CODE_BITS[name], 32)
    np.testing.assert_array_equal(gq.affine_values(affine), dequantize(blocks, T[name]))


# ---------------------------------------------------------------------------
# a tiny llama GGUF with K-quant tensors (rows of 256: one super-block per row)

HIDDEN, FFN, N_HEADS, N_KV, VOCAB = 256, 512, 4, 2, 259
SHAPES = {
    "blk.0.attn_q": (HIDDEN, HIDDEN),
    "blk.0.attn_k": (N_KV * HIDDEN // N_HEADS, HIDDEN),
    "blk.0.attn_v": (N_KV * HIDDEN // N_HEADS, HIDDEN),
    "blk.0.attn_output": (HIDDEN, HIDDEN),
    "blk.0.ffn_gate": (FFN, HIDDEN),
    "blk.0.ffn_up": (FFN, HIDDEN),
    "blk.0.ffn_down": (HIDDEN, FFN),
    "token_embd": (VOCAB, HIDDEN),
    "output": (VOCAB, HIDDEN),
}
MODULES = {
    "blk.0.attn_q": "model.layers.0.self_attn.q_proj",
    "blk.0.attn_k": "model.layers.0.self_attn.k_proj",
    "blk.0.attn_v": "model.layers.0.self_attn.v_proj",
    "blk.0.attn_output": "model.layers.0.self_attn.o_proj",
    "blk.0.ffn_gate": "model.layers.0.mlp.gate_proj",
    "blk.0.ffn_up": "model.layers.0.mlp.up_proj",
    "blk.0.ffn_down": "model.layers.0.mlp.down_proj",
    "token_embd": "model.embed_tokens",
    "output": "lm_head",
}
KQ_TYPES = {  # a K_M-like mix: K-quants, plus exact types beside them (Q8_0: see test_gguf.py)
    "blk.0.attn_q": "Q4_K",  # also checks the Q/K row un-permutation of kept codes
    "blk.0.attn_k": "Q5_K",
    "blk.0.attn_v": "Q6_K",
    "blk.0.attn_output": "Q4_K",
    "blk.0.ffn_gate": "Q5_0",
    "blk.0.ffn_up": "Q5_1",
    "blk.0.ffn_down": "Q6_K",
    "token_embd": "Q4_0",
    "output": "Q4_1",
}


def write_kquant_gguf(path, types: dict[str, str] = KQ_TYPES) -> dict[str, np.ndarray]:
    """Returns {GGUF name: the float32 weights the file holds, in HF row order}."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>", "<unk>"] + byte_alphabet())
    w.add_token_types([3, 3, 2] + [1] * 256)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    reference = {}
    for name, type_name in types.items():
        rows, cols = SHAPES[name]
        if type_name in KQUANTS:
            data = kquant_blocks(type_name, rows, cols, seed=rows + cols + len(name))
        elif type_name in gq.CODEBOOK:
            data = iq4_blocks(type_name, rows, cols, seed=rows + cols + len(name))
        else:
            data = quantize(
                rng.standard_normal((rows, cols)).astype(np.float32) * 0.02, T[type_name]
            )
        w.add_tensor(f"{name}.weight", data, raw_dtype=T[type_name])
        ref = dequantize(data, T[type_name]).astype(np.float32)
        heads = {"blk.0.attn_q": N_HEADS, "blk.0.attn_k": N_KV}.get(name)
        reference[name] = hf_order(ref, heads) if heads else ref
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{name}.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("kq")
    reference = write_kquant_gguf(root / "kq.gguf")
    logs = []
    report = import_gguf(root / "kq.gguf", root / "model", log=logs.append)
    return root, reference, report, logs


def test_kquant_import_formats_are_recorded_per_module(kquant_model):
    root, _, report, _ = kquant_model
    config = json.loads((root / "model" / "config.json").read_text())

    def fmt(bits):
        return {"group_size": 32, "bits": bits, "mode": "affine"}

    assert config["quantization"] == {
        **fmt(4),  # the most common: q_proj and o_proj (Q4_K, codes kept), embed_tokens, lm_head
        "model.layers.0.self_attn.k_proj": fmt(5),  # Q5_K, codes kept
        "model.layers.0.self_attn.v_proj": fmt(8),  # Q6_K -> 8-bit
        "model.layers.0.mlp.down_proj": fmt(8),  # Q6_K -> 8-bit
        "model.layers.0.mlp.gate_proj": fmt(5),  # Q5_0, exact
        "model.layers.0.mlp.up_proj": fmt(5),  # Q5_1, exact
    }
    assert report["quantization"] == config["quantization"]


def test_exact_types_beside_kquants_stay_bit_identical(kquant_model):
    root, reference, _, _ = kquant_model
    weights = mx.load(str(root / "model" / "model.safetensors"))
    quant = json.loads((root / "model" / "config.json").read_text())["quantization"]
    for name, type_name in KQ_TYPES.items():
        if type_name in EXACT:
            np.testing.assert_array_equal(
                dequantized(weights, MODULES[name], quant), reference[name], name
            )


def test_kquant_loss_is_reported_and_true(kquant_model):
    root, reference, report, logs = kquant_model
    weights = mx.load(str(root / "model" / "model.safetensors"))
    quant = json.loads((root / "model" / "config.json").read_text())["quantization"]
    losses = report["kquant_loss"]
    assert sorted(losses) == sorted(
        f"{MODULES[n]}.weight" for n, t in KQ_TYPES.items() if t in KQUANTS
    )
    for name, type_name in KQ_TYPES.items():
        if type_name not in KQUANTS:
            continue
        loss = losses[f"{MODULES[name]}.weight"]
        stored = dequantized(weights, MODULES[name], quant)
        err = stored.astype(np.float64) - reference[name]
        assert loss["type"] == type_name and loss["codes_kept"] == (type_name != "Q6_K")
        assert loss["max_abs"] == pytest.approx(np.abs(err).max(), rel=1e-6)
        assert loss["rel_rmse"] == pytest.approx(
            np.sqrt((err**2).mean() / (reference[name] ** 2).mean()), rel=1e-4
        )
        # Kept codes lose only float16 rounding of scale and bias; 8-bit re-quantization a
        # small fraction of Q6_K's own step.
        assert loss["rel_rmse"] < (2e-3 if loss["codes_kept"] else 1e-2), (name, loss)
    assert len(logs) == 1 and "5 K-quant tensors" in logs[0] and "relative RMS error" in logs[0]


IQ4_TYPES = {**KQ_TYPES, "blk.0.attn_q": "IQ4_XS", "blk.0.attn_k": "IQ4_NL"}
IQ4_TYPES.update({"blk.0.attn_v": "IQ4_NL", "blk.0.ffn_down": "IQ4_XS"})


def layer_format(quant: dict, module: str) -> dict:
    """A module's format in a config's quantization record: its own entry, else the default."""
    return quant.get(module) or {k: quant[k] for k in ("group_size", "bits", "mode")}


def test_iq4_file_imports_as_8_bit_levels_and_requantizes(tmp_path):
    """A file mixing IQ4_NL/IQ4_XS with other types (what llama.cpp's IQ4_XS recipe writes
    when rows are not a multiple of 256): the IQ4 tensors land in 8-bit groups of 32 with
    the file's values (IQ4_NL bit for bit, IQ4_XS within float16 scale rounding, its loss
    reported), and ``requantize`` re-codes them like K-quants."""
    reference = write_kquant_gguf(tmp_path / "iq4.gguf", IQ4_TYPES)
    report = import_gguf(tmp_path / "iq4.gguf", tmp_path / "model")
    weights = mx.load(str(tmp_path / "model" / "model.safetensors"))
    quant = json.loads((tmp_path / "model" / "config.json").read_text())["quantization"]
    iq4 = [n for n, t in IQ4_TYPES.items() if t in gq.CODEBOOK]
    for name in iq4:
        assert layer_format(quant, MODULES[name]) == {"group_size": 32, "bits": 8, "mode": "affine"}
        stored = dequantized(weights, MODULES[name], quant)
        if IQ4_TYPES[name] == "IQ4_NL":
            np.testing.assert_array_equal(stored, reference[name], name)
        else:
            ref = reference[name].reshape(-1, 32)
            bound = np.abs(ref).max(axis=1, keepdims=True) * 2.0**-11
            assert (np.abs(stored.reshape(-1, 32) - ref) <= bound).all(), name
    assert {k for k, v in report["kquant_loss"].items() if v["type"] in gq.CODEBOOK} == {
        f"{MODULES[n]}.weight" for n in iq4
    }
    from mlxinfer.loading.loader import load_model

    model, _ = load_model(tmp_path / "model", dtype=mx.float32)
    assert model.layers[0].self_attn.q_proj.bits == 8

    import_gguf(tmp_path / "iq4.gguf", tmp_path / "re", requantize=(4, 64))
    quant = json.loads((tmp_path / "re" / "config.json").read_text())["quantization"]
    for name in iq4:
        assert layer_format(quant, MODULES[name]) == {"group_size": 64, "bits": 4, "mode": "affine"}


def test_imported_kquant_model_runs(kquant_model):
    from mlxinfer.loading.loader import load_model

    root, _, _, _ = kquant_model
    model, _ = load_model(root / "model", dtype=mx.float32)
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert model.layers[0].self_attn.k_proj.bits == 5 and model.layers[0].mlp.down_proj.bits == 8
    logits = model(mx.array([[3, 40, 41, 200]]))
    assert logits.shape == (1, 4, VOCAB) and np.isfinite(np.array(logits)).all()


def test_requantize_option_applies_to_kquants_only(kquant_model, tmp_path):
    root, reference, _, _ = kquant_model
    report = convert(root / "kq.gguf", tmp_path / "g64", quantize=True, bits=4, group_size=64)
    quant = json.loads((tmp_path / "g64" / "config.json").read_text())["quantization"]
    for name, type_name in KQ_TYPES.items():
        module = MODULES[name]
        entry = quant.get(module, {k: quant[k] for k in ("bits", "group_size")})
        if type_name in KQUANTS:
            assert (entry["bits"], entry["group_size"]) == (4, 64), name
            assert report["kquant_loss"][f"{module}.weight"]["codes_kept"] is False
        else:
            assert (entry["bits"], entry["group_size"]) == (gq.EXACT_BITS[type_name], 32), name
    weights = mx.load(str(tmp_path / "g64" / "model.safetensors"))
    q = dequantized(weights, "model.layers.0.self_attn.q_proj", quant)
    err = np.sqrt(
        np.mean((q - reference["blk.0.attn_q"]) ** 2) / np.mean(reference["blk.0.attn_q"] ** 2)
    )
    assert err == pytest.approx(
        report["kquant_loss"]["model.layers.0.self_attn.q_proj.weight"]["rel_rmse"], rel=1e-4
    )


def test_requantize_rejects_unsupported_format(kquant_model, tmp_path):
    root = kquant_model[0]
    with pytest.raises(Exception, match="group size 32, 64 or 128"):
        import_gguf(root / "kq.gguf", tmp_path / "x", requantize=(4, 16))


# ---------------------------------------------------------------------------
# types we do not read


@pytest.mark.parametrize(
    "ggml_type,name", [(T.Q2_K, "Q2_K"), (T.Q3_K, "Q3_K"), (T.IQ3_S, "IQ3_S"), (T.Q8_1, "Q8_1")]
)
def test_unsupported_type_is_a_one_line_error_naming_it(tmp_path, ggml_type, name):
    from gguf.constants import GGML_QUANT_SIZES

    block, nbytes = GGML_QUANT_SIZES[ggml_type]
    w = gguf.GGUFWriter(str(tmp_path / "u.gguf"), "llama")
    w.add_tensor(
        "token_embd.weight", np.zeros((2, 256 // block * nbytes), np.uint8), raw_dtype=ggml_type
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        WeightsError, match=f"tensor token_embd.weight has unsupported type {name} "
    ) as e:
        import_gguf(tmp_path / "u.gguf", tmp_path / "out")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_llama_cpp_permute_helper_round_trips():
    a = np.arange(64 * 3).reshape(64, 3)
    np.testing.assert_array_equal(hf_order(llama_cpp_permute(a, 4), 4), a)


def test_mlx_runs_5_bit_linear_and_embedding_on_this_backend():
    """Q5_0/Q5_1 land in 5-bit layers: MLX must multiply and look up with them."""
    import mlx.nn as nn

    linear = nn.Linear(64, 16).to_quantized(group_size=32, bits=5)
    embedding = nn.Embedding(100, 64).to_quantized(group_size=32, bits=5)
    x = mx.random.normal((2, 64), key=mx.random.key(0))
    dense = mx.dequantize(linear.weight, linear.scales, linear.biases, group_size=32, bits=5)
    np.testing.assert_allclose(np.array(linear(x)), np.array(x @ dense.T + linear.bias), atol=1e-5)
    table = mx.dequantize(
        embedding.weight, embedding.scales, embedding.biases, group_size=32, bits=5
    )
    ids = mx.array([[1, 5, 99]])
    np.testing.assert_array_equal(np.array(embedding(ids)), np.array(table[ids]))
