"""import_gguf on the real Gemma-3-270M Q4_K_M file (a base model): weights against the ``gguf``
package's dequantizer, config and K-quant formats, tokenizer and greedy output against transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf_tiny import (  # noqa: E402
    MULTILINGUAL,
    dequantized,
    sentencepiece_vocab,
)

from mlxinfer.loading.convert import convert  # noqa: E402


@pytest.fixture(scope="module")
def spm_vocab(tmp_path_factory):
    return sentencepiece_vocab(tmp_path_factory.mktemp("spm"))


# ---------------------------------------------------------------------------
# the real Gemma-3-270M Q4_K_M file (base model, not instruction-tuned)


@pytest.fixture(scope="module")
def gemma3():
    """(gguf path, our import) -- cached on disk."""
    from fixtures import gemma3_gguf_path, gemma3_mlx_dir

    return gemma3_gguf_path(), gemma3_mlx_dir()


@pytest.mark.real
def test_real_gemma3_weights_vs_gguf_reference(gemma3):
    """Exact types bit-identical; K-quant decoding bit-identical and the stored loss as reported.
    The reference is the ``gguf`` package's reading (tests/fixtures/reference/gemma3_tensors.json:
    each tensor's raw bytes and float32 decoding as SHA-256; its reader takes ~11 s to parse the
    262k vocabulary strings): the bytes our reader finds hash as its, and every array compared
    bit for bit hashes as the package's."""
    import mmap

    from fixtures import reference_fixture

    import mlxinfer.gguf.quants as gq
    from mlxinfer.gguf.container import read_gguf_header, tensor_bytes

    gguf_path, mlx_dir = gemma3
    frozen = reference_fixture("gemma3_tensors")["tensors"]
    with open(gguf_path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        tensors = read_gguf_header(gguf_path, buf)[1]
        raws = {name: np.array(tensor_bytes(buf, tensors[name])) for name in frozen}
        buf.close()
    ours = mx.load(str(mlx_dir / "model.safetensors"))
    quant = json.loads((mlx_dir / "config.json").read_text())["quantization"]
    for name, ref in frozen.items():
        t = tensors[name]
        assert t.type_name == ref["type"], name
        if "raw_sha256" in ref:
            assert sha256(raws[name]) == ref["raw_sha256"], name
        if "module" not in ref:  # a norm: stored as w - 1 (Gemma's 1 + w)
            module = hf_gemma_norm(name)
            assert sha256(np.array(ours[f"{module}.weight"], np.float32)) == ref["sha256"], name
            continue
        module, type_name, shape = ref["module"], ref["type"], tuple(ref["shape"])
        if type_name in ("Q4_K", "Q6_K"):  # our decoder on real blocks, as the package's
            decoded = gq.dequantize(raws[name], type_name, shape)
            assert sha256(decoded.astype(np.float32)) == ref["sha256"], name
            stored = dequantized(ours, module, quant)
            rel_rmse = np.sqrt(
                np.mean((stored - decoded) ** 2) / np.mean(decoded.astype(np.float64) ** 2)
            )
            assert rel_rmse < (1e-3 if type_name == "Q4_K" else 1e-2), name
            continue
        if name == "token_embd.weight":  # the same first rows
            rows = shape[0]
            stored = np.array(
                mx.dequantize(
                    ours[f"{module}.weight"][:rows],
                    ours[f"{module}.scales"][:rows].astype(mx.float32),
                    ours[f"{module}.biases"][:rows].astype(mx.float32),
                    group_size=32,
                    bits=8,
                )
            )
        else:
            stored = dequantized(ours, module, quant)
        assert stored.shape == shape and sha256(stored.astype(np.float32)) == ref["sha256"], name


def sha256(a: np.ndarray) -> str:
    """As tools/make_reference_fixtures.py's: -0.0 hashes as 0.0 (equal values, equal hashes)."""
    import hashlib

    a = np.ascontiguousarray(a)
    if a.dtype.kind == "f":
        a = a + a.dtype.type(0)
    return hashlib.sha256(a.tobytes()).hexdigest()


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
    from mlxinfer.backends.cpu import compiled, tiles
    from mlxinfer.backends.cpu import plans as cpu_plans
    from mlxinfer.generation import generate_step

    _, mlx_dir = gemma3
    # float32 activations: on the CPU, MLX's float16 kernels are ~50x slower, and Gemma's
    # activations overflow float16 anyway; the float16 scales widen exactly.
    model, tok = mlxinfer.load(mlx_dir, dtype=mx.float32)
    cpu = getattr(model, "backend", None) == "cpu"
    if cpu:  # as a user runs it: the compiled kernels
        # (~9x MLX's loop over its 5-bit layers; the plain path: tests/models/test_families.py)
        cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
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
    if cpu and tiles.available():  # decode through tiles, as a machine's plans may choose: the
        # Q5_0 and Q8_0 layers (the 262k-row head among them) symmetric, their biases dropped
        plans = {**cpu_plans.forced_plans("kernels"), "int16_decode": "int16"}
        try:
            cpu_plans.set_plans(model, plans)
            ours = [t for t, _ in generate_step(prompts["qa"], model, max_tokens=16)]
            assert ours[: len(reference["qa"])] == reference["qa"], tok.decode(ours)
            # each tiled layer, or stacked group of siblings (q/k/v, gate/up: tiled once), and
            # the file's tensors it holds
            owners = {id(m): (m, 1) for m in model.modules()}
            for m in model.modules():
                group = m.__dict__.get("cpu_fused", (None,))[0]
                if group is not None:
                    owners[id(group)] = (group, len(group.bounds))
            dropped = sum(
                n
                for owner, n in owners.values()
                if (kept := owner.__dict__.get("_cpu_tiles")) and kept[3] is not None
                if kept[3][2].shape == (0,)
            )
            assert dropped == 91, dropped  # 81 Q5_0 + 10 Q8_0 tensors in the file
        finally:
            compiled.set_int16_decode(False)
    answer = mlxinfer.generate(model, tok, GEMMA3_PROMPTS["qa"], max_tokens=4, chat_template=False)
    assert answer.strip().startswith("Paris")


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="~40 s on 2 cores, outside the suite's 10 minutes (test_families.py checks the clip on "
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
        # on the compiled kernels, as a user runs it (the plans forced: no timing)
        env={**os.environ, "MLXINFER_CPU_PLANS": "kernels"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    assert "no chat template, so the prompt goes to the model as raw text" in out.stderr


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="~30 s on 2 cores, outside the suite's 10 minutes (the exact dequantization is checked "
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
