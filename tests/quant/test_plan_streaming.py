"""A mixed-precision plan made layer by layer (issue 48, item 5): the same plan as with the whole
model in memory, while about one block's weights are resident at a time.

The model's parameters are lazy loads of its safetensors file; ``plan_model(weights=...)``
puts fresh lazy loads back once a pass is through a block (``quant/layerwise.py``).
"""

import gc
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxinfer  # noqa: F401  (before any model module: the package sets MLX up)
from mlxinfer.loading.convert import convert
from mlxinfer.models import build_model
from mlxinfer.quant import layerwise
from mlxinfer.quant.mixed import plan_model
from mlxinfer.quant.transform import quantize_model

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
FAMILIES = {
    "llama-untied": dict(model_type="llama", tie_word_embeddings=False),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "gemma3_text": dict(
        model_type="gemma3_text",
        head_dim=16,
        sliding_window=6,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
}


def _save(path, config, seed=0):
    """A random float32 checkpoint of ``config``, named as the model names its parameters."""
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(config, "config.json")
    mx.random.seed(seed)
    params = {
        k: mx.random.normal(v.shape) * 0.08 if v.ndim > 1 else v
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(path / "model.safetensors"), params)
    return path / "model.safetensors"


def _lazy(config, file):
    """A model whose parameters are lazy loads of ``file``, and fresh ones by path."""
    model = build_model(config, "config.json")

    def fresh():
        return dict(mx.load(str(file)))

    model.load_weights(list(fresh().items()))
    return model, fresh


def _tokens(n=600, vocab=256, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_streaming_plan_measures_and_chooses_what_the_in_memory_one_does(
    tmp_path, monkeypatch, family
):
    config = {**BASE, **FAMILIES[family]}
    # The final logits 40 positions at a time (of 96): as a 262k-token vocabulary would be.
    monkeypatch.setattr(layerwise, "LOGIT_ELEMENTS", 40 * 256)
    file = _save(tmp_path, config)
    # 600 tokens at ctx 256: two sequences of 256 and one of 88 (two calibration batches).
    kwargs = dict(vocab=256, bpw=4.5, calibration_tokens=600, probe_tokens=96)
    whole, _ = _lazy(config, file)
    mx.eval(whole.parameters())
    said: list[str] = []
    want = plan_model(whole, _tokens(), **kwargs)
    model, fresh = _lazy(config, file)
    got = plan_model(model, _tokens(), weights=fresh, log=said.append, **kwargs)
    assert not any("in memory" in s for s in said), said  # the streaming probe ran
    assert got.settings == want.settings
    assert got.costs.keys() == want.costs.keys() and len(got.costs) > 4 * 7
    for path, cost in want.costs.items():
        assert got.costs[path]["alpha"] == pytest.approx(cost["alpha"], rel=1e-5, abs=1e-9), path
        for key, e in cost["errors"].items():
            assert got.costs[path]["errors"][key] == pytest.approx(e, rel=1e-5, abs=1e-9), path
    assert got.measured_kl == pytest.approx(want.measured_kl, rel=1e-5)
    assert got.predicted_kl == pytest.approx(want.predicted_kl, rel=1e-5)
    for path, s in want.sums.items():
        np.testing.assert_allclose(got.sums[path], s, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got.counts[path], want.counts[path])
    # Every parameter is a lazy load again: nothing of the passes is kept.
    assert all(not _evaluated(v) for _, v in tree_flatten(model.parameters()))


def _evaluated(a: mx.array) -> bool:
    """Whether ``a`` holds data (a lazy load does not until it is evaluated)."""
    before = mx.get_active_memory()
    mx.eval(a)
    return mx.get_active_memory() == before


BIG = dict(
    BASE,
    model_type="llama",
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_key_value_heads=4,
    tie_word_embeddings=True,
)


def test_planning_holds_a_few_blocks_not_the_model(tmp_path, monkeypatch):
    """8 blocks of 3.4 MB: the plan's peak stays under three blocks' worth plus the probe's
    hidden states and activations, far below the 27.5 MB of weights (with the release step
    disabled it is above them)."""
    file = _save(tmp_path, BIG)
    model, fresh = _lazy(BIG, file)
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    block = sum(v.nbytes for _, v in tree_flatten(model.layers[0].parameters()))
    assert total > 7.5 * block
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    plan = plan_model(
        model,
        _tokens(128),
        vocab=256,
        bpw=4.5,
        calibration_tokens=128,
        probe_tokens=32,
        weights=fresh,
    )
    peak = mx.get_peak_memory() - base
    assert plan.measured_kl is not None and plan.measured_kl >= 0
    # The probe carries one (32, 256) float32 state per probed tensor and head setting.
    variants = (8 * 7 + 18) * 32 * 256 * 4
    assert peak < 3 * block + variants + 2_000_000, (peak, block, total)
    assert peak < total / 2
    # Then the rounding: each float weight read, rounded and dropped (none kept alive by the
    # passes' hooks even while the garbage collector waits), the quantized model beside it.
    from mlxinfer.quant import rounding

    monkeypatch.setattr(rounding, "FIT_CHUNK", 1 << 16)  # as a large model's layers are fitted
    mx.reset_peak_memory()
    gc.disable()
    try:
        quantize_model(model, rounding="mse", layers=plan.layers(), importance=plan.mean)
        held = mx.get_active_memory() - base
    finally:
        gc.enable()
    assert held < total / 4, (held, total)
    assert mx.get_peak_memory() - base < total / 2


def test_convert_plans_layer_by_layer(tmp_path):
    """``convert -q`` runs the streaming passes (no fallback to the in-memory probe) and
    writes a model that loads."""
    from tiny_checkpoint import write_checkpoint

    write_checkpoint(tmp_path / "hf")
    said: list[str] = []
    convert(tmp_path / "hf", tmp_path / "q", quantize=True, log=said.append)
    assert said and not any("in memory" in s for s in said), said
    record = json.loads((tmp_path / "q" / "quantization-plan.json").read_text())
    assert record["measured_kl"] >= 0 and record["settings"]
    model, _ = mlxinfer.load(tmp_path / "q")
    assert np.isfinite(np.array(model(mx.array([[1, 2, 3]])))).all()


def test_a_model_the_stream_cannot_follow_is_measured_in_memory(tmp_path, monkeypatch):
    """Blocks that do not chain raise Unsupported; the plan falls back to the in-memory probe
    and still gives the in-memory figures."""
    config = {**BASE, **FAMILIES["llama-untied"]}
    file = _save(tmp_path, config)
    kwargs = dict(vocab=256, bpw=4.5, calibration_tokens=300, probe_tokens=64)
    want = plan_model(_lazy(config, file)[0], _tokens(), **kwargs)

    def unsupported(self, t):
        raise layerwise.Unsupported("test")

    monkeypatch.setattr(layerwise.StreamProbe, "place", unsupported)
    said: list[str] = []
    model, fresh = _lazy(config, file)
    got = plan_model(model, _tokens(), weights=fresh, log=said.append, **kwargs)
    assert any("in memory" in s for s in said)
    assert got.settings == want.settings
    assert got.measured_kl == pytest.approx(want.measured_kl, rel=1e-5)


def test_large_tensors_round_a_chunk_at_a_time_to_the_same_values(monkeypatch):
    """Fake quantization, its weighted error and the least-squares fit of a tensor over the
    chunk size run a chunk of rows (of experts) at a time, to the whole tensor's values."""
    from mlxinfer.quant import plan, rounding

    mx.random.seed(3)
    w = mx.random.normal((300, 128)) * 0.05
    experts = mx.random.normal((5, 40, 128)) * 0.05
    imp = np.random.default_rng(0).random(128).astype(np.float32) + 0.1
    s = plan.Setting(3, 64)
    whole = plan.fake_quantized(w, s), plan.weighted_error(w, s, imp)
    fits = [
        rounding.fit_affine(a, group_size=32, bits=4, weights=v)
        for a, v in (
            (w, rounding.channel_weights(imp, w.shape)),
            (experts, rounding.channel_weights(np.stack([imp] * 5), experts.shape)),
        )
    ]
    monkeypatch.setattr(plan, "CHUNK", 128 * 70)  # 5 chunks of rows, the last partial
    monkeypatch.setattr(rounding, "FIT_CHUNK", 40 * 128 * 2)  # 2 experts at a time
    assert len(plan._chunks(w)) == 5
    assert mx.array_equal(plan.fake_quantized(w, s), whole[0])
    assert plan.weighted_error(w, s, imp) == pytest.approx(whole[1], rel=1e-6)
    for (a, v), want in zip(
        (
            (w, rounding.channel_weights(imp, w.shape)),
            (experts, rounding.channel_weights(np.stack([imp] * 5), experts.shape)),
        ),
        fits,
    ):
        got = rounding.fit_affine(a, group_size=32, bits=4, weights=v)
        assert all(mx.array_equal(x, y) for x, y in zip(got, want))


def test_a_planned_conversion_writes_shards_as_layers_are_quantized(tmp_path, monkeypatch):
    """Shards are written while the layers are quantized: a small shard size gives an index
    and several files, and the model they hold is the one-file conversion's, bit for bit."""
    from tiny_checkpoint import write_checkpoint

    from mlxinfer.loading import shards

    write_checkpoint(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "one", quantize=True)
    monkeypatch.setattr(shards, "SHARD_BYTES", 4096)
    events: list = []
    convert(
        tmp_path / "hf",
        tmp_path / "many",
        quantize=True,
        progress=lambda *e: events.append(e),
    )
    writing = [(d, t) for s, d, t in events if s == "writing weights"]
    assert writing[-1][0] == writing[-1][1] > 0
    assert all(a[0] <= b[0] for a, b in zip(writing, writing[1:])), writing
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    files = sorted((tmp_path / "many").glob("model-*-of-*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == {f.name for f in files}
    assert not list((tmp_path / "many").glob(".shard*"))
    one = mx.load(str(tmp_path / "one" / "model.safetensors"))
    many = {k: v for f in files for k, v in mx.load(str(f)).items()}
    assert many.keys() == one.keys() == index["weight_map"].keys()
    assert [k for k in one if not mx.array_equal(many[k], one[k])] == []
    model, _ = mlxinfer.load(tmp_path / "many")
    assert np.isfinite(np.array(model(mx.array([[1, 2, 3]])))).all()


def test_a_float_conversion_in_shards_holds_the_one_file_weights(tmp_path, monkeypatch):
    from tiny_checkpoint import write_checkpoint

    from mlxinfer.loading import shards

    write_checkpoint(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "one", dtype="float32")
    monkeypatch.setattr(shards, "SHARD_BYTES", 8192)
    convert(tmp_path / "hf", tmp_path / "many", dtype="float32")
    one = mx.load(str(tmp_path / "one" / "model.safetensors"))
    files = sorted((tmp_path / "many").glob("model-*-of-*.safetensors"))
    many = {k: v for f in files for k, v in mx.load(str(f)).items()}
    assert len(files) > 2 and many.keys() == one.keys()
    assert [k for k in one if not mx.array_equal(many[k], one[k])] == []
