"""GLM-4.5 (``glm4moe``) GGUF import keeps the MTP layer (issue #45): a tiny random GLM-4.5 with
one MTP layer (tests/support/mtp_models.py's ``make_nextn``), written as llama.cpp's converter
writes it (``gguf``'s own tensor-name map for GLM4_MOE, experts stacked, ``e_score_correction``
as ``exp_probs_b.bias``, ``block_count`` = trunk + MTP layers, ``blk.L.nextn.*``), imports into
a model whose trunk and MTP head compute what the safetensors checkpoint and transformers do."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
import torch  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import quantize  # noqa: E402
from gguf_tiny import SPECIALS, finish  # noqa: E402
from hf_models import torch_greedy  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mtp_models import GLM, make_nextn  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_gguf_architectures import BPE_MERGES, BPE_TOKENS  # noqa: E402
from transformers.cache_utils import MtpCache  # noqa: E402

from mlxinfer.errors import WeightsError  # noqa: E402
from mlxinfer.generation import generate_step  # noqa: E402
from mlxinfer.generation.mtp_drafts import MTP  # noqa: E402
from mlxinfer.generation.speculative import speculative_generate_step  # noqa: E402
from mlxinfer.gguf import import_gguf  # noqa: E402
from mlxinfer.loading.loader import load_model  # noqa: E402

IDS = [5, 17, 33, 2, 99, 120, 7, 64, 3, 11, 42, 8]
SPEC = {**GLM, "vocab_size": len(BPE_TOKENS), "routed_scaling_factor": 2.5}
L = 2  # the trunk's layers (hf_models.TINY); the MTP layer is blk.2


def to_gguf(weights: dict) -> dict[str, np.ndarray]:
    """An HF GLM-4.5 checkpoint's tensors under llama.cpp's names (convert_hf_to_gguf.py's
    Glm4MoeModel: gguf's tensor-name map, per-expert weights stacked (E, out, in))."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, L + 1)
    out, experts = {}, {}
    for key, value in weights.items():
        a = value.float().numpy()
        parts = key.split(".")
        if ".mlp.experts." in key:  # model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = a
            continue
        key = key.replace("e_score_correction_bias", "e_score_correction.bias")
        new = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert new is not None, key
        out[new] = a
    for (layer, proj), by_expert in experts.items():
        base = f"model.layers.{layer}.mlp.experts.{proj}"
        stacked = np.stack([by_expert[e] for e in range(len(by_expert))])
        out[names.get_name(base) + ".weight"] = stacked
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def write_glm_gguf(path: Path, tensors: dict, config, types: dict | None = None) -> None:
    """The metadata convert_hf_to_gguf.py writes for GLM-4.5 (TextModel's and Glm4MoeModel's),
    and a byte-level BPE vocabulary as the other GGUF tests write it."""
    w = gguf.GGUFWriter(str(path), "glm4moe")
    w.add_block_count(config.num_hidden_layers + config.num_nextn_predict_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_expert_used_count(config.num_experts_per_tok)
    head_dim = config.hidden_size // config.num_attention_heads
    w.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
    w.add_expert_count(config.n_routed_experts)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_expert_shared_count(config.n_shared_experts)
    w.add_leading_dense_block_count(config.first_k_dense_replace)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(config.routed_scaling_factor)
    w.add_expert_weights_norm(config.norm_topk_prob)
    w.add_nextn_predict_layers(config.num_nextn_predict_layers)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(BPE_TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(BPE_TOKENS) - len(SPECIALS)))
    w.add_token_merges(BPE_MERGES)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for name, x in tensors.items():
        ggml_type = (types or {}).get(name.split(".")[-2], T.F32) if x.ndim >= 2 else T.F32
        data = x if ggml_type == T.F32 else quantize(x, ggml_type)
        w.add_tensor(name, data, raw_dtype=None if ggml_type == T.F32 else ggml_type)
    finish(w)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(root, GGUF tensors, transformers trunk, MtpModel, safetensors-loaded model, ours)."""
    root = tmp_path_factory.mktemp("glm4moe")
    path, trunk, mtp = make_nextn(root / "hf", SPEC)
    tensors = to_gguf(load_file(str(path / "model.safetensors")))
    write_glm_gguf(root / "glm.gguf", tensors, trunk.config)
    import_gguf(root / "glm.gguf", root / "ours")
    return root, tensors, trunk, mtp, load_model(path)[0], load_model(root / "ours")[0]


def test_file_has_the_nextn_tensors_llama_cpp_writes(glm):
    _, tensors, *_ = glm
    assert {n for n in tensors if ".nextn." in n} == {
        f"blk.{L}.nextn.{p}.weight"
        for p in ("eh_proj", "enorm", "hnorm", "shared_head_norm", "embed_tokens",
                  "shared_head_head")
    }  # fmt: skip
    assert f"blk.{L}.exp_probs_b.bias" in tensors and f"blk.{L}.ffn_gate_exps.weight" in tensors
    assert tensors["blk.1.ffn_down_exps.weight"].shape == (8, 64, 32)  # (E, H, I)


def test_config_is_the_source_config(glm):
    root, _, trunk, *_ = glm
    ours = json.loads((root / "ours" / "config.json").read_text())
    src = trunk.config.to_dict()
    assert ours["model_type"] == "glm4_moe"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "intermediate_size", "n_routed_experts", "num_experts_per_tok",
                "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace", "n_group",
                "topk_group", "norm_topk_prob", "routed_scaling_factor", "attention_bias",
                "use_qk_norm", "tie_word_embeddings", "max_position_embeddings"):  # fmt: skip
        assert ours[key] == src[key], key
    assert ours["num_nextn_predict_layers"] == 1
    assert ours["partial_rotary_factor"] == src["rope_parameters"]["partial_rotary_factor"]
    assert ours["rope_theta"] == src["rope_parameters"]["rope_theta"]


def test_weights_equal_the_safetensors_models(glm):
    """Every parameter, the MTP head's included, is the checkpoint's (the copies of the
    embedding and LM head go: the trunk's serve)."""
    *_, st, ours = glm
    a, b = dict(tree_flatten(st.parameters())), dict(tree_flatten(ours.parameters()))
    assert set(a) == set(b)
    assert any(k.startswith("model.mtp_layers.0.eh_proj") for k in b)
    for k in a:
        np.testing.assert_array_equal(np.array(b[k]), np.array(a[k]), err_msg=k)


def head_rows(model, ids):
    """The MTP head's logits over the prompt's pairs, then two chained steps (as
    tests/models/test_nextn_mtp.py runs it)."""
    hidden, logits = model.trunk(mx.array([ids]))
    head = model.mtp_heads[0]
    c = head.make_cache()
    rows = []
    for j in range(len(ids) - 1):
        g = head(mx.array([[ids[j + 1]]]), hidden[:, j : j + 1], c)
        rows.append(np.array(head.logits(g)[0, 0]))
    for _ in range(2):
        g = head(mx.array([[int(np.argmax(rows[-1]))]]), g, c)
        rows.append(np.array(head.logits(g)[0, 0]))
    return np.array(logits[0]), np.stack(rows)


def test_trunk_and_head_logits_match_safetensors_and_transformers(glm):
    _, _, trunk, mtp, st, ours = glm
    logits, rows = head_rows(ours, IDS)
    st_logits, st_rows = head_rows(st, IDS)
    np.testing.assert_allclose(logits, st_logits, atol=1e-3)
    np.testing.assert_allclose(rows, st_rows, atol=1e-3)
    T_ = len(IDS)
    with torch.no_grad():
        out = trunk(torch.tensor([IDS]), output_hidden_states=True)
        h = out.hidden_states[-1]
        cache = MtpCache(config=trunk.config.get_mtp_config())
        g = mtp.forward_layer(
            0, h[:, :-1], torch.arange(1, T_)[None], cache, input_ids=torch.tensor([IDS[1:]])
        )
        ref = [mtp._project_to_logits(g)[0].numpy()]
        for i in range(2):
            token = int(ref[-1][-1].argmax())
            g = mtp.forward_layer(
                0, g[:, -1:], torch.tensor([[T_ + i]]), cache, input_ids=torch.tensor([[token]])
            )
            ref.append(mtp._project_to_logits(g)[0].numpy())
    np.testing.assert_allclose(logits, out.logits[0].numpy(), atol=1e-3)
    np.testing.assert_allclose(rows, np.concatenate(ref), atol=1e-3)


def test_greedy_with_mtp_equals_plain_greedy(glm):
    _, _, trunk, _, _, ours = glm
    plain = [t for t, _ in generate_step(IDS, ours, max_tokens=16)]
    steps = list(speculative_generate_step(IDS, ours, MTP(), max_tokens=16, num_draft=2))
    assert [s[0] for s in steps] == plain == torch_greedy(trunk, IDS, 16)
    assert sum(s[4] for s in steps) > 0  # some drafts were accepted


def test_quantized_file_keeps_a_quantized_head(glm, tmp_path):
    """Q8_0 attention, experts and eh_proj (the router and norms F32, as llama.cpp keeps them):
    the head's modules quantized like the trunk's; MTP greedy still equals plain greedy."""
    _, tensors, trunk, *_ = glm
    types = {p: T.Q8_0 for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps",
                                 "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp",
                                 "ffn_down_shexp", "eh_proj")}  # fmt: skip
    write_glm_gguf(tmp_path / "q8.gguf", tensors, trunk.config, types)
    import_gguf(tmp_path / "q8.gguf", tmp_path / "q8")
    quant = json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"]
    assert quant["bits"] == 8
    assert quant.get("model.mtp_layers.0.eh_proj", quant) is quant  # the top-level record
    assert quant["model.mtp_layers.0.mlp.gate"] is False
    model = load_model(tmp_path / "q8")[0]
    assert len(model.mtp_heads) == 1
    plain = [t for t, _ in generate_step(IDS, model, max_tokens=10)]
    drafted = [s[0] for s in speculative_generate_step(IDS, model, MTP(), max_tokens=10)]
    assert drafted == plain


def test_float32_import_keeps_the_head(glm, tmp_path):
    """``convert x.gguf --dtype float32`` (dense.py's path): the same parameters, the head's too."""
    from mlxinfer.loading.convert import convert

    root, *_, ours = glm
    convert(root / "glm.gguf", tmp_path / "f32", dtype="float32")
    model = load_model(tmp_path / "f32")[0]
    a, b = dict(tree_flatten(ours.parameters())), dict(tree_flatten(model.parameters()))
    assert set(a) == set(b) and len(model.mtp_heads) == 1
    for k in a:
        np.testing.assert_array_equal(np.array(b[k]), np.array(a[k]), err_msg=k)


def rewrite(glm, path: Path, keep) -> Path:
    _, tensors, trunk, *_ = glm
    write_glm_gguf(path, {k: v for k, v in tensors.items() if keep(k)}, trunk.config)
    return path


def test_file_without_the_mtp_layer_loads_without_heads(glm, tmp_path):
    """The MTP layer stripped (nextn_predict_layers still 1): the trunk alone, same tokens."""
    *_, ours = glm
    src = rewrite(glm, tmp_path / "stripped.gguf", lambda k: not k.startswith(f"blk.{L}."))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: no tensor of the layer was dropped
        import_gguf(src, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (L, 1)
    model = load_model(tmp_path / "out")[0]
    assert model.mtp_heads == []
    assert [t for t, _ in generate_step(IDS, model, max_tokens=6)] == [
        t for t, _ in generate_step(IDS, ours, max_tokens=6)
    ]


def test_file_without_nextn_tensors_drops_the_layer_with_a_warning(glm, tmp_path):
    *_, ours = glm
    src = rewrite(glm, tmp_path / "no-nextn.gguf", lambda k: ".nextn." not in k)
    with pytest.warns(RuntimeWarning, match=f"MTP layer {L} has no nextn tensors"):
        import_gguf(src, tmp_path / "out")
    model = load_model(tmp_path / "out")[0]
    assert model.mtp_heads == []
    assert [t for t, _ in generate_step(IDS, model, max_tokens=6)] == [
        t for t, _ in generate_step(IDS, ours, max_tokens=6)
    ]


def test_missing_nextn_tensor_is_named(glm, tmp_path):
    src = rewrite(glm, tmp_path / "partial.gguf", lambda k: k != f"blk.{L}.nextn.hnorm.weight")
    with pytest.raises(WeightsError, match=f"expected tensor blk.{L}.nextn.hnorm.weight") as e:
        import_gguf(src, tmp_path / "out")
    assert str(src) in str(e.value)
    assert not (tmp_path / "out").exists()


def test_nextn_tensor_in_a_trunk_layer_is_named(glm, tmp_path):
    _, tensors, trunk, *_ = glm
    bad = {**tensors, "blk.0.nextn.enorm.weight": tensors[f"blk.{L}.nextn.enorm.weight"]}
    write_glm_gguf(tmp_path / "bad.gguf", bad, trunk.config)
    with pytest.raises(WeightsError, match="unexpected tensor blk.0.nextn.enorm.weight"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out")


def test_layer_past_block_count_is_named(glm, tmp_path):
    _, tensors, trunk, *_ = glm
    bad = {**tensors, f"blk.{L + 1}.attn_norm.weight": tensors["blk.0.attn_norm.weight"]}
    write_glm_gguf(tmp_path / "bad.gguf", bad, trunk.config)
    with pytest.raises(
        WeightsError, match=rf"blk.{L + 1}.attn_norm.weight: expected layers 0..{L}"
    ):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out")


def test_softmax_gating_is_refused(glm, tmp_path):
    from mlxinfer.errors import ConfigError

    shutil.copy(glm[0] / "glm.gguf", tmp_path / "g.gguf")
    data = (tmp_path / "g.gguf").read_bytes()
    key = b"glm4moe.expert_gating_func"
    at = data.index(key) + len(key) + 4  # the key, then its uint32 type tag, then the value
    assert int.from_bytes(data[at : at + 4], "little") == 2
    (tmp_path / "g.gguf").write_bytes(data[:at] + (1).to_bytes(4, "little") + data[at + 4 :])
    with pytest.raises(ConfigError, match="glm4moe.expert_gating_func: expected 2 .*found 1"):
        import_gguf(tmp_path / "g.gguf", tmp_path / "out")
