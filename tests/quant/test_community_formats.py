"""Every MLX community quantization format loads: mlx-lm's own conversions of a tiny random llama
(uniform affine, its mixed recipes, its float modes) give the same float32 logits through our
loader as through mlx-lm's; a record MLX cannot load is our one-line error, not MLX's traceback.

mlx-lm is a test peer only (mlxinfer never imports it)."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from hf_models import add_tokenizer, make_tiny

from mlxinfer.errors import ConfigError
from mlxinfer.loading.loader import load_model

mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm (the peer these formats come from)")
from mlx_lm.utils import load_model as peer_load_model  # noqa: E402

IDS = mx.array([[5, 17, 99, 3, 240, 8, 61, 2]])

# name -> mlx_lm.convert keyword arguments
FORMATS = {
    "affine_4bit": {"q_bits": 4, "q_group_size": 64},
    "affine_3bit_g32": {"q_bits": 3, "q_group_size": 32},
    "mixed_3_6": {"quant_predicate": "mixed_3_6"},  # per-layer entries with group_size: null
    "mixed_4_6": {"quant_predicate": "mixed_4_6"},
    "mxfp4": {"q_mode": "mxfp4"},
    "nvfp4": {"q_mode": "nvfp4"},
    "mxfp8": {"q_mode": "mxfp8"},
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("hf") / "tiny")
    add_tokenizer(path)
    # mlx-lm reads transformers 4's top-level rope_theta, not transformers 5's rope_parameters:
    # without it, it would run the model at another theta.
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def skip_unless_peer_makes(kwargs: dict) -> None:
    """Skip (saying why) a format this mlx-lm cannot write, or MLX cannot store on the CPU."""
    params = inspect.signature(mlx_lm.convert).parameters
    if "q_mode" in kwargs and "q_mode" not in params:
        pytest.skip(f"mlx-lm {mlx_lm.__version__} has no q_mode (MLX's float modes)")
    recipe = kwargs.get("quant_predicate")
    if recipe is not None:
        from mlx_lm.convert import QUANT_RECIPES

        if recipe not in QUANT_RECIPES:
            pytest.skip(f"mlx-lm {mlx_lm.__version__} has no {recipe} recipe")
    mode = kwargs.get("q_mode", "affine")
    try:
        mx.eval(mx.quantize(mx.ones((32, 64)), mode=mode))
    except (ValueError, RuntimeError) as e:
        pytest.skip(f"MLX's {mx.default_device()} backend cannot quantize mode {mode}: {e}")


def peer_convert(hf_dir: Path, out: Path, **kwargs) -> Path:
    with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm prints its progress
        mlx_lm.convert(str(hf_dir), str(out), quantize=True, **kwargs)
    return out


@pytest.fixture(scope="module")
def affine_dir(hf_dir, tmp_path_factory):
    return peer_convert(hf_dir, tmp_path_factory.mktemp("q") / "affine", q_bits=4, q_group_size=64)


def logits_of_both(model_dir: Path) -> tuple[mx.array, mx.array]:
    peer, _ = peer_load_model(model_dir)
    ours, _ = load_model(model_dir)
    return ours(IDS).astype(mx.float32), peer(IDS).astype(mx.float32)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_mlx_lm_conversions_give_mlx_lms_logits(hf_dir, tmp_path, name):
    skip_unless_peer_makes(FORMATS[name])
    model_dir = peer_convert(hf_dir, tmp_path / name, **FORMATS[name])
    record = json.loads((model_dir / "config.json").read_text())["quantization"]
    if name.startswith("mixed"):  # what made these refused: mlx-lm's null group size
        assert record["model.layers.0.mlp.down_proj"]["group_size"] is None
    ours, peer = logits_of_both(model_dir)
    assert ours.shape == peer.shape
    assert mx.abs(ours - peer).max().item() <= 1e-3


def test_the_quantization_record_wins_over_quantization_config(affine_dir, tmp_path):
    # mlx-lm writes both (equal, for the Hub's model tree) and reads `quantization` first.
    model_dir = shutil.copytree(affine_dir, tmp_path / "both")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (model_dir / "config.json").write_text(json.dumps(config))
    ours, peer = logits_of_both(model_dir)
    assert mx.abs(ours - peer).max().item() <= 1e-3


def test_a_layer_set_to_false_stays_in_float(hf_dir, tmp_path):
    def keep_head(path, module):
        return "lm_head" not in path

    model_dir = peer_convert(hf_dir, tmp_path / "head", quant_predicate=keep_head)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization"]["lm_head"] = False
    (model_dir / "config.json").write_text(json.dumps(config))
    ours, peer = logits_of_both(model_dir)
    assert mx.abs(ours - peer).max().item() <= 1e-3
    model, _ = load_model(model_dir)
    assert "scales" not in model.lm_head and "scales" in model.model.layers[0].mlp.down_proj


LAYER = "model.layers.0.mlp.down_proj"
BAD_RECORDS = {
    "bits 7": (
        {LAYER: {"group_size": 64, "bits": 7, "mode": "affine"}},
        f"'quantization.{LAYER}.bits' must be 2, 3, 4, 5, 6 or 8 for mode 'affine', found 7",
    ),
    "unknown mode": (
        {"mode": "int4"},
        "'quantization.mode' must be one of 'affine', 'mxfp4', 'nvfp4', 'mxfp8', found 'int4'",
    ),
    "a group size mxfp4 lacks": (
        {LAYER: {"group_size": 64, "bits": 4, "mode": "mxfp4"}},
        f"'quantization.{LAYER}.group_size' must be 32 for mode 'mxfp4', found 64",
    ),
    "nvfp4's global scale": (
        {LAYER: {"group_size": 16, "bits": 4, "mode": "nvfp4", "global_scale": True}},
        f"'quantization.{LAYER}.global_scale' is not supported",
    ),
    "a layer given as a number": ({LAYER: 4}, f"'quantization.{LAYER}' must be an object or false"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_a_record_mlx_cannot_load_is_one_line_naming_key_expected_and_found(
    affine_dir, tmp_path, case
):
    change, message = BAD_RECORDS[case]
    model_dir = shutil.copytree(affine_dir, tmp_path / "bad")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization"].update(change)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        load_model(model_dir)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(str(model_dir / "config.json"))


@pytest.mark.parametrize("name", ["mixed_3_6", "mxfp4", "nvfp4"])
def test_a_community_format_decodes_the_same_in_a_batch_as_alone(hf_dir, tmp_path, name):
    """Loaded with the backend's layers (mlxinfer.load), three prompts of different lengths in
    one batch of the engine give each prompt's greedy tokens alone."""
    from mlxinfer import batch_generate, load, stream_generate

    skip_unless_peer_makes(FORMATS[name])
    model, tokenizer = load(str(peer_convert(hf_dir, tmp_path / name, **FORMATS[name])))
    prompts = [[5, 17, 99], [3, 240, 8, 61, 2, 44, 19, 7, 88, 120, 31], [250]]
    alone = [
        [r.token for r in stream_generate(model, tokenizer, p, max_tokens=12)] for p in prompts
    ]
    assert all(alone)  # each generated something to compare
    texts = batch_generate(model, tokenizer, prompts, max_tokens=12)
    assert texts == [tokenizer.decode(ids) for ids in alone]


def test_our_mixed_plan_loads_in_mlx_lm_with_our_logits(hf_dir, tmp_path):
    """A measured mixed plan (per-layer bits and groups, 16-bit scales on a float32 model) is
    MLX's own format: mlx-lm loads it and computes our logits. We widen the 16-bit scales to
    the model's float32 on load; mlx-lm keeps them and MLX dequantizes in float16, each weight
    rounded to 11 bits (measured: ours within 2e-6 of the exactly dequantized model, mlx-lm
    1.5e-3), so the bound here is 5e-3, not the 1e-3 of float32 products."""
    from mlxinfer.loading.convert import convert

    (tmp_path / "calib.txt").write_text(" ".join(f"w{i % 61} n{i * 7 % 89}." for i in range(600)))
    out = tmp_path / "ours"
    convert(hf_dir, out, bpw=4.5, dtype="float32", calibration=tmp_path / "calib.txt")
    record = json.loads((out / "config.json").read_text())["quantization"]
    assert len({(v["bits"], v["group_size"]) for v in record.values() if isinstance(v, dict)}) > 1
    ours, peer = logits_of_both(out)
    assert mx.abs(ours - peer).max().item() <= 5e-3


def test_layers_the_record_does_not_list_take_their_settings_from_the_shapes(hf_dir, tmp_path):
    """A mixed recipe's record stripped of its per-layer entries (only the defaults left): each
    layer's bits and group follow from its packed weight's and scales' widths, and the logits
    are mlx-lm's on the intact record."""
    skip_unless_peer_makes(FORMATS["mixed_3_6"])
    intact = peer_convert(hf_dir, tmp_path / "intact", **FORMATS["mixed_3_6"])
    stripped = shutil.copytree(intact, tmp_path / "stripped")
    config = json.loads((stripped / "config.json").read_text())
    record = config["quantization"]
    listed = [k for k, v in record.items() if isinstance(v, dict)]
    assert listed  # there were entries to lose
    config["quantization"] = {k: v for k, v in record.items() if not isinstance(v, dict)}
    config.pop("quantization_config", None)
    (stripped / "config.json").write_text(json.dumps(config))
    peer, _ = peer_load_model(intact)
    ours, _ = load_model(stripped)
    diff = mx.abs(ours(IDS).astype(mx.float32) - peer(IDS).astype(mx.float32)).max().item()
    assert diff <= 1e-3
