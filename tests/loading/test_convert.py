"""`convert`: HF checkpoint → model directory; quantization record; bad input."""

import copy
import json
import os
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hf_models import add_tokenizer, make_tiny, torch_logits

from mlxinfer.cache.prompt import PromptCache
from mlxinfer.cli.main import cli
from mlxinfer.errors import ConfigError, TokenizerError, WeightsError
from mlxinfer.generation.prefill import prefill
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model

IDS = [5, 17, 99, 3, 240, 8, 61, 130, 2, 77, 19, 200]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path, torch_model = make_tiny(tmp_path_factory.mktemp("hf") / "tiny", vocab_size=320)
    add_tokenizer(path)
    return path, torch_model


def test_f32_conversion_keeps_logits_and_copies_tokenizer(hf_dir, tmp_path):
    src, torch_model = hf_dir
    report = convert(src, tmp_path / "out", dtype="float32")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    model, config = load_model(tmp_path / "out")
    assert config["torch_dtype"] == "float32" and report["bits_per_weight"] == 32
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - torch_logits(torch_model, IDS)).max() <= 1e-3


@pytest.mark.parametrize(
    "bits,group,dtype,bpw",
    [
        (4, 64, "float16", 4 + 2 * 16 / 64),
        (4, 32, "float32", 4 + 2 * 32 / 32),
        (8, 64, "float32", 8 + 2 * 32 / 64),
    ],
)
def test_quantized_conversion_records_and_reloads(hf_dir, tmp_path, bits, group, dtype, bpw):
    src, torch_model = hf_dir
    report = convert(src, tmp_path / "q", quantize=True, bits=bits, group_size=group, dtype=dtype)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"] == {"group_size": group, "bits": bits, "mode": "affine"}
    # bits per weight = bits + (scale + bias) per group; every layer here is quantized.
    assert report["bits_per_weight"] == pytest.approx(bpw)
    assert report["bytes"] > 0
    model, _ = load_model(tmp_path / "q")
    out = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    assert np.isfinite(out).all()
    if dtype == "float32":
        assert (
            np.abs(out - torch_logits(dequantized_reference(torch_model, model), IDS)).max() <= 1e-3
        )


def dequantized_reference(torch_model, model):
    """The transformers model with each weight replaced by ``model``'s dequantized value of it."""
    ref_model = copy.deepcopy(torch_model)
    state = ref_model.state_dict()
    for path, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(
                module.weight,
                module.scales,
                module.biases,
                group_size=module.group_size,
                bits=module.bits,
            )
            state[f"{path}.weight"] = torch.from_numpy(np.array(w))
    ref_model.load_state_dict(state)
    return ref_model


def test_long_quantized_prefill_runs_stepwise_and_matches_transformers(tmp_path, monkeypatch):
    """A 4-bit prefill long enough for the stepwise path (attention block by block, MLP slice by slice)."""
    from mlxinfer.backends.cpu import quantized as quant

    src, torch_model = make_tiny(
        tmp_path / "hf",
        vocab_size=320,
        intermediate_size=quant.MLP_SLICE + 128,
        max_position_embeddings=512,
    )
    add_tokenizer(src)
    convert(src, tmp_path / "q", quantize=True, bits=4, group_size=64, dtype="float32")
    model, _ = load_model(tmp_path / "q")
    sliced, calls = quant.sliced_mlp, []
    monkeypatch.setattr(quant, "sliced_mlp", lambda *args: calls.append(args) or sliced(*args))
    ids = [(7 + 37 * i) % 320 for i in range(300)]
    cache = PromptCache(model.make_cache())
    prefill(model, cache, ids[:-1])
    out = np.array(model(mx.array([ids[-1:]]), cache.cache)[0, -1])
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    assert len(calls) == (
        len(model.layers) if on_cpu else 0
    )  # one sliced MLP per layer on the CPU backend
    assert not quant.stepwise()  # only inside the prefill
    ref = torch_logits(dequantized_reference(torch_model, model), ids)[-1]
    assert np.abs(out - ref).max() <= 1e-3


def test_sharded_checkpoint_is_read(hf_dir, tmp_path):
    src, torch_model = hf_dir
    sharded = tmp_path / "sharded"
    torch_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, sharded / f)
    convert(sharded, tmp_path / "out", dtype="float32")
    model, _ = load_model(tmp_path / "out")
    assert (
        np.abs(np.array(model(mx.array([IDS]))[0]) - torch_logits(torch_model, IDS)).max() <= 1e-3
    )


def broken(hf_dir, tmp_path, how):
    src, _ = hf_dir
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    if how == "missing config":
        (bad / "config.json").unlink()
    elif how == "unknown model_type":
        (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "transformer9000"}))
    elif how == "missing key":
        del cfg["hidden_size"]
        (bad / "config.json").write_text(json.dumps(cfg))
    elif how == "truncated":
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "shape mismatch":
        (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    elif how == "missing tokenizer":
        (bad / "tokenizer.json").unlink()
        (bad / "tokenizer_config.json").unlink()
    elif how == "pickle only":
        (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    return bad


BAD = {
    "missing config": (ConfigError, "config.json: missing config.json"),
    "unknown model_type": (ConfigError, "unknown model_type 'transformer9000'"),
    "missing key": (ConfigError, "missing required key 'hidden_size'"),
    "truncated": (WeightsError, r"model.safetensors: (truncated|not a valid)"),
    "shape mismatch": (
        WeightsError,
        r"weight 'model.layers.\d.mlp.\w+_proj.weight' has shape \(\d+, \d+\), "
        r"expected \(\d+, \d+\)",
    ),
    "missing tokenizer": (TokenizerError, "bad: no tokenizer found"),
    "pickle only": (WeightsError, "only pickle weights \\(pytorch_model.bin\\)"),
}


@pytest.mark.parametrize("how", sorted(BAD))
def test_bad_input_is_one_line_error_and_leaves_nothing(hf_dir, tmp_path, how):
    bad = broken(hf_dir, tmp_path, how)
    error, pattern = BAD[how]
    with pytest.raises(error, match=pattern) as info:
        convert(bad, tmp_path / "out")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]  # no temporary leftovers either
    result = CliRunner().invoke(cli, ["convert", str(bad), "-o", str(tmp_path / "out2")])
    last = result.output.strip().split("\r")[-1].splitlines()[-1]  # after any progress-bar redraws
    assert result.exit_code == 1 and last.startswith("Error: ") and str(info.value) in last
    assert not (tmp_path / "out2").exists()


def test_cli_convert_reports_size(hf_dir, tmp_path):
    src, _ = hf_dir
    result = CliRunner().invoke(
        cli, ["convert", str(src), "-o", str(tmp_path / "q"), "-q", "--group-size", "32"]
    )
    assert result.exit_code == 0, result.output
    assert "bits per weight" in result.output and "MiB on disk" in result.output
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "q").stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700


def test_existing_output_is_refused(hf_dir, tmp_path):
    src, _ = hf_dir
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists"):
        convert(src, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_cpu_prefill_path_equals_quantized_kernel():
    from mlxinfer.backends.cpu.layers import swap_layers
    from mlxinfer.backends.cpu.quantized import CPUQuantizedLinear

    layer = nn.QuantizedLinear(128, 96, bias=True, group_size=64, bits=4)
    layer.update({"bias": mx.random.normal((96,), key=mx.random.key(1))})
    x = mx.random.normal(
        (2, 40, 128), key=mx.random.key(2)
    )  # 80 rows: the dequantize + matmul path
    ref = layer(x)  # MLX's quantized_matmul
    holder = nn.Sequential(layer)
    assert swap_layers(holder) == 1 and isinstance(layer, CPUQuantizedLinear)
    assert np.abs(np.array(layer(x)) - np.array(ref)).max() < 1e-4
    one_row = x[:, :1]
    assert mx.array_equal(layer(one_row), nn.QuantizedLinear.__call__(layer, one_row))


def test_cpu_float_linear_split_over_two_streams_equals_one_product():
    from mlxinfer.backends.cpu.layers import swap_layers
    from mlxinfer.backends.cpu.parallel import CPULinear, PaddedLinear

    big = nn.Linear(512, CPULinear.MIN_SIZE // 512, bias=True)  # just large enough to switch
    small = nn.Linear(64, 64)
    x = mx.random.normal((1, 3, 512), key=mx.random.key(3))  # decode-sized: the split path
    ref = big(x)
    switched = swap_layers(nn.Sequential(big, small))
    # The small one only may pad its few-row products (never, until pad_rows is set).
    assert switched == 2 and isinstance(big, CPULinear) and type(small) is PaddedLinear
    assert np.abs(np.array(big(x)) - np.array(ref)).max() < 1e-4
    many = mx.random.normal((1, 40, 512), key=mx.random.key(4))  # prefill: one product
    assert mx.array_equal(big(many), nn.Linear.__call__(big, many))


@pytest.mark.parametrize(
    "suffix,named",
    [("qweight", "GPTQ/AWQ"), ("weight_scale_inv", "FP8"), ("absmax", "bitsandbytes")],
)
def test_another_quantization_format_is_named_not_unexpected(hf_dir, tmp_path, suffix, named):
    """A HF checkpoint quantized by AutoGPTQ/AutoAWQ, FP8 or bitsandbytes holds weights MLX's
    layers have no place for: the error names the format and what to do instead."""
    src = shutil.copytree(hf_dir[0], tmp_path / "foreign")
    weights = mx.load(str(src / "model.safetensors"))
    weights[f"model.layers.0.mlp.down_proj.{suffix}"] = mx.zeros((4, 4), mx.int32)
    mx.save_safetensors(str(src / "model.safetensors"), weights)
    with pytest.raises(WeightsError) as e:
        load_model(src)
    message = str(e.value)
    assert named in message and "dequantize" in message and "\n" not in message
