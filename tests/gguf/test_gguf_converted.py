"""GGUF files made by llama.cpp's own converter from tiny random transformers checkpoints, frozen
with transformers' answers (tools/make_gguf_fixtures.py, float16): Qwen3.5/3.6 (``qwen35``,
``qwen35moe``; value heads 2 per key head) and Qwen3-Next (``qwen3next``) with an MTP layer,
GLM-4.7-Flash (``deepseek2`` with an MTP layer), DeepSeek-V3 (``deepseek2``, sigmoid routing in
groups, YaRN; the converter drops its MTP layer), a V2-Lite-like model (``deepseek2``, no
query bottleneck, softmax routing), a Llama with Llama 3.1's RoPE scaling (``llama``, the
scaling as the ``rope_freqs`` tensor), Qwen2.5 (``qwen2``, tied, biases), Gemma 2 (``gemma2``:
soft-capping, a window shorter than the prompt), Phi-4-mini (``phi3``: fused q/k/v and gate/up,
LongRoPE over 3/4 of each head with its factors as tensors; an 80-token prompt takes the long
ones), SmolLM3 (``smollm3``: every 4th layer without RoPE), OLMo 2/3 (``olmo2``; OLMo 3's
sliding layers from the file's pattern, a window shorter than the prompt) and Ministral 3
(``mistral3``: YaRN and Llama 4's query scaling, which the 80-token prompt reaches) and LFM2
(``lfm2``: short-convolution layers, per-layer KV head counts), and Granite 3.x (``granite``: its
four multipliers). The import must undo everything the converter did (Qwen3.5's
value heads reordered, Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` split, ``1 + w`` norms,
``-exp(A_log)``, the squeezed conv kernel, MLA's ``kv_b_proj`` split into a transposed
``attn_k_b`` and ``attn_v_b``, ``mtp.*`` as ``blk.N.nextn.*``, the routing and YaRN as
metadata, Llama 3.1's scaling as factors): the trunk's logits, the MTP head's (with its cache, then chained on its own output)
and the greedy tokens are transformers' (issues #45, #48's "every format loads")."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from gguf_tiny import finish  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from mlxinfer.errors import WeightsError  # noqa: E402
from mlxinfer.generation import generate_step  # noqa: E402
from mlxinfer.generation.mtp_drafts import MTP  # noqa: E402
from mlxinfer.generation.speculative import speculative_generate_step  # noqa: E402
from mlxinfer.gguf import import_gguf, qwen35  # noqa: E402
from mlxinfer.loading.loader import load_model  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "gguf"
ARCHS = ("qwen35", "qwen35moe", "qwen3next", "glm4moelite", "deepseek3", "deepseek2lite", "llama31",
         "qwen2", "gemma2", "phi4mini", "smollm3", "olmo2", "olmo3", "ministral3", "lfm2",
         "granite")  # fmt: skip
WITH_MTP = ("qwen35", "qwen35moe", "qwen3next", "glm4moelite")
KEEP_FLOAT = ("ssm_alpha", "ssm_ba")  # float modules in a quantized file: named in the record
ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # llama.cpp's quantizer leaves them float


_IMPORTED: dict = {}


def import_fixture(arch: str, tmp_path_factory):
    """(arch, reference arrays, our model imported from the llama.cpp-made file), once."""
    if arch not in _IMPORTED:
        out = tmp_path_factory.mktemp(arch) / "ours"
        import_gguf(FIXTURES / f"{arch}.gguf", out)
        ref = load_file(str(FIXTURES / f"{arch}.reference.safetensors"))
        _IMPORTED[arch] = arch, ref, load_model(out)[0]
    return _IMPORTED[arch]


@pytest.fixture(scope="module", params=ARCHS)
def imported(request, tmp_path_factory):
    return import_fixture(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=WITH_MTP)
def imported_with_mtp(request, tmp_path_factory):
    return import_fixture(request.param, tmp_path_factory)


def head_rows(model, ids: list[int]) -> np.ndarray:
    """The MTP head's logits at every prompt pair, then chained twice on its greedy token."""
    hidden, _ = model.trunk(mx.array([ids]))
    head = model.mtp_heads[0]
    cache, rows = head.make_cache(), []
    for j in range(len(ids) - 1):
        g = head(mx.array([[ids[j + 1]]]), hidden[:, j : j + 1], cache)
        rows.append(np.array(head.logits(g)[0, 0]))
    for _ in range(2):
        g = head(mx.array([[int(np.argmax(rows[-1]))]]), g, cache)
        rows.append(np.array(head.logits(g)[0, 0]))
    return np.stack(rows)


def test_trunk_and_mtp_head_match_transformers(imported):
    arch, ref, model = imported
    ids = ref["ids"].tolist()
    np.testing.assert_allclose(np.array(model(mx.array([ids]))[0]), ref["logits"], atol=1e-4)
    assert len(model.mtp_heads) == (arch in WITH_MTP)
    if arch in WITH_MTP:
        np.testing.assert_allclose(head_rows(model, ids), ref["mtp_logits"], atol=1e-4)
    greedy = [t for t, _ in generate_step(ids, model, max_tokens=len(ref["greedy"]))]
    assert greedy == ref["greedy"].tolist()
    if "long_logits" in ref:  # 80 tokens: past the RoPE-scaled configs' 64 original positions
        long = np.array(model(mx.array([ref["long_ids"].tolist()]))[0, -8:])
        np.testing.assert_allclose(long, ref["long_logits"], atol=1e-4)


def test_mtp_drafting_keeps_the_greedy_tokens(imported_with_mtp):
    _, ref, model = imported_with_mtp
    ids, n = ref["ids"].tolist(), len(ref["greedy"])
    steps = list(speculative_generate_step(ids, model, MTP(), max_tokens=n, num_draft=2))
    assert [s[0] for s in steps] == ref["greedy"].tolist()
    assert sum(s[4] for s in steps) > 0  # drafts were made and verified


def rewrite(src: Path, dst: Path, kind) -> None:
    """``src`` again with every matrix whose rows split into 32-wide blocks as ``kind``: T.Q8_0
    (as llama.cpp's quantizer stores it) or T.F32 holding the Q8_0 values (the same model)."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        x = dequantize(t.data, t.tensor_type).astype(np.float32)
        if (
            x.ndim >= 2
            and x.shape[-1] % 32 == 0
            and not any(f".{part}." in t.name for part in ("ssm_conv1d", *KEEP_FLOAT, *ROUTERS))
        ):
            q = quantize(x, T.Q8_0)
            if kind == T.Q8_0:
                w.add_tensor(t.name, q, raw_dtype=T.Q8_0)
                continue
            x = dequantize(q, T.Q8_0).reshape(x.shape)
        w.add_tensor(t.name, np.ascontiguousarray(x))
    finish(w)


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_file_is_the_float_file_of_its_values(arch, tmp_path):
    """A Q8_0 file keeps its codes and is the model of the float file holding those values:
    Qwen3.5's value heads put back inside the quantized arrays (rows of attn_qkv, attn_gate,
    ssm_beta; ssm_out's 32-wide column blocks, one head each), Qwen3-Next's ssm_ba split by rows
    into the two projections the record then names as float, MLA's transposed attn_k_b
    multiplied as stored."""
    src = FIXTURES / f"{arch}.gguf"
    for kind, name in ((T.Q8_0, "q8"), (T.F32, "f32")):
        rewrite(src, tmp_path / f"{name}.gguf", kind)
        import_gguf(tmp_path / f"{name}.gguf", tmp_path / name)
    import_gguf(tmp_path / "q8.gguf", tmp_path / "dense", dtype="float32")  # dense.py's path
    q8, f32 = load_model(tmp_path / "q8")[0], load_model(tmp_path / "f32")[0]
    dense = load_model(tmp_path / "dense")[0]
    record = json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"]
    if arch.startswith("qwen3"):
        assert "scales" in q8.model.layers[0].linear_attn.out_proj  # stayed quantized
        assert record["model.layers.0.linear_attn.in_proj_a"] is False
        if arch == "qwen3next":
            assert record["model.layers.0.linear_attn.in_proj_b"] is False
    elif arch in (
        "llama31",
        "qwen2",
        "gemma2",
        "smollm3",
        "olmo2",
        "olmo3",
        "ministral3",
        "granite",
    ):
        assert "scales" in q8.model.layers[0].self_attn.q_proj
    elif arch == "lfm2":
        assert "scales" in q8.model.layers[0].conv.in_proj
    elif arch == "phi4mini":
        assert "scales" in q8.model.layers[0].self_attn.qkv_proj
    else:
        assert "scales" in q8.model.layers[0].self_attn.k_b_proj  # (heads, rank, nope) codes
    ids = load_file(str(FIXTURES / f"{arch}.reference.safetensors"))["ids"].tolist()
    want = np.array(f32(mx.array([ids])))
    for model in (q8, dense):
        np.testing.assert_allclose(np.array(model(mx.array([ids]))), want, atol=1e-4)
        if arch in WITH_MTP:
            np.testing.assert_allclose(head_rows(model, ids), head_rows(f32, ids), atol=1e-4)


def test_value_heads_the_file_cannot_move_are_our_error():
    config = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_value_head_dim": 16,
              "linear_key_head_dim": 16}  # fmt: skip
    how = qwen35.value_head_order(config, "model.layers.0.linear_attn.out_proj", "weight")
    assert how == ("columns", 16, 0)
    # 64 columns in 32-wide blocks: each block holds two value heads
    with pytest.raises(
        WeightsError, match=r"blk\.0\.ssm_out\.weight: 2 stored columns .* 4 value heads"
    ):
        qwen35.regroup(
            {"scales": np.zeros((8, 2), np.float32)}, config, how, "blk.0.ssm_out.weight"
        )
    with pytest.raises(WeightsError, match=r"blk\.0\.ssm_a: expected -exp\(A_log\) < 0"):
        qwen35.fix_float("model.layers.0.linear_attn", "A_log", np.array([-1.0, 0.5], np.float32),
                         "blk.0.ssm_a")  # fmt: skip


def test_deepseek2_files_from_before_the_k_b_split_load_too(tmp_path):
    """llama.cpp's converter wrote ``attn_kv_b`` (HF's ``kv_b_proj``) and per-head key and value
    lengths before it split MLA for the absorbed form: the same model from such a file."""
    src = FIXTURES / "deepseek2lite.gguf"
    reader = gguf.GGUFReader(str(src))
    md = {k: f.contents() for k, f in reader.fields.items()}
    rope = md["deepseek2.rope.dimension_count"]
    nope, v = (
        md["deepseek2.attention.key_length_mla"] - rope,
        md["deepseek2.attention.value_length_mla"],
    )
    w = gguf.GGUFWriter(str(tmp_path / "old.gguf"), "deepseek2")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.endswith("_mla"):
            continue
        value = {"deepseek2.attention.key_length": nope + rope,
                 "deepseek2.attention.value_length": v}.get(key, field.contents())  # fmt: skip
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub_type=sub)
    tensors = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    for name, x in tensors.items():
        if ".attn_v_b." in name:
            continue
        if ".attn_k_b." in name:  # (H, rank, nope) and (H, v, rank) -> (H * (nope + v), rank)
            v_b = tensors[name.replace("attn_k_b", "attn_v_b")]
            kv_b = np.concatenate([x.swapaxes(1, 2), v_b], axis=1)
            w.add_tensor(name.replace("attn_k_b", "attn_kv_b"), kv_b.reshape(-1, kv_b.shape[-1]))
            continue
        w.add_tensor(name, np.ascontiguousarray(x))
    finish(w)
    import_gguf(tmp_path / "old.gguf", tmp_path / "old")
    assert not json.loads((tmp_path / "old" / "config.json").read_text())["k_b_proj_transposed"]
    ref = load_file(str(FIXTURES / "deepseek2lite.reference.safetensors"))
    model = load_model(tmp_path / "old")[0]
    logits = np.array(model(mx.array([ref["ids"].tolist()]))[0])
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4)


def test_llama31_rope_freqs_become_its_rope_scaling(tmp_path_factory):
    _, _, model = import_fixture("llama31", tmp_path_factory)
    assert model.args.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }  # fmt: skip


def test_rope_freqs_of_another_form_are_our_error():
    from mlxinfer.gguf.rope_freqs import llama3_scaling

    assert llama3_scaling(Path("m.gguf"), np.ones(8, np.float32), 10000.0, 16) is None
    with pytest.raises(
        WeightsError, match=r"m\.gguf: tensor rope_freqs\.weight has 4 values; expected 8"
    ):
        llama3_scaling(Path("m.gguf"), np.ones(4, np.float32), 10000.0, 16)
    bumpy = np.array([1, 2, 1, 8, 8, 8, 8, 8], np.float32)  # not monotone: no llama3 setting
    with pytest.raises(WeightsError, match=r"m\.gguf: tensor rope_freqs\.weight: "):
        llama3_scaling(Path("m.gguf"), bumpy, 10000.0, 16)
    for bad in (np.nan, np.inf, 0.0, -1.0):  # each was a bare ValueError/ZeroDivisionError
        with pytest.raises(WeightsError, match=r"expected finite divisors of at least 1"):
            llama3_scaling(Path("m.gguf"), np.full(8, bad, np.float32), 10000.0, 16)


def with_tensor(src: Path, dst: Path, name: str, values: np.ndarray) -> Path:
    """``src`` again with tensor ``name`` set to ``values`` (added if absent)."""
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, values if t.name == name else np.ascontiguousarray(t.data))
    if name not in {t.name for t in reader.tensors}:
        w.add_tensor(name, values)
    finish(w)
    return dst


@pytest.mark.parametrize(
    ("arch", "name", "values", "message"),
    [
        # no family but llama reads rope_freqs: dropped, the model would run without its scaling
        ("qwen2", "rope_freqs.weight", np.full(8, 2.0, np.float32),
         r"tensor rope_freqs\.weight is not supported for qwen2"),
        ("phi4mini", "rope_factors_long.weight", np.full(6, np.nan, np.float32),
         r"rope_factors_long/_short: expected finite positive factors"),
        ("llama31", "rope_freqs.weight", np.full(8, -1.0, np.float32),
         r"rope_freqs\.weight: expected finite divisors of at least 1"),
    ],
)  # fmt: skip
def test_setting_tensors_a_model_cannot_use_are_refused(arch, name, values, message, tmp_path):
    src = with_tensor(FIXTURES / f"{arch}.gguf", tmp_path / "m.gguf", name, values)
    with pytest.raises(WeightsError, match=message):
        import_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written
