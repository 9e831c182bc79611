"""Least-squares rounding (issue 48, item 3): never worse than min/max, MLX's format unchanged."""

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from hf_models import add_tokenizer, make_tiny

import mlxinfer
from mlxinfer.cli.main import cli
from mlxinfer.errors import ConfigError
from mlxinfer.loading.convert import convert
from mlxinfer.quant.rounding import fit_affine, pack

IDS = np.random.default_rng(0).integers(0, 320, (4, 64))  # (B, L): enough tokens to average


def group_errors(w, wq, scales, biases, group_size, bits):
    """Squared error of ``mx.dequantize``'s reconstruction, per group: (groups,)."""
    dq = mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)
    err = mx.square(dq.astype(mx.float32) - w.astype(mx.float32))
    return np.array(err.reshape(-1, group_size).sum(-1))


def weights(kind, shape=(96, 512)):
    rng = np.random.default_rng(0)
    if kind == "normal":
        return mx.array(rng.normal(0, 0.05, shape).astype(np.float32))
    return mx.array((rng.standard_t(2, shape) * 0.02).astype(np.float32))  # heavy tails


@pytest.mark.parametrize("kind", ["normal", "heavy"])
@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, 32), (3, 64), (8, 128), (2, 32)])
def test_fit_is_never_worse_than_minmax_and_better_on_average(kind, bits, group_size):
    w = weights(kind)
    minmax = group_errors(w, *mx.quantize(w, group_size=group_size, bits=bits), group_size, bits)
    fitted = group_errors(w, *fit_affine(w, group_size=group_size, bits=bits), group_size, bits)
    assert (fitted <= minmax * (1 + 1e-6) + 1e-12).all()
    assert fitted.mean() < 0.97 * minmax.mean()


@pytest.mark.parametrize("packed_at_once", [1 << 22, 300])  # one slice; slices of one row
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_is_mlx_layout(bits, packed_at_once, monkeypatch):
    from mlxinfer.quant import rounding

    monkeypatch.setattr(rounding, "PACK_CODES", packed_at_once)
    w = weights("normal", (8, 256))
    wq, scales, biases = mx.quantize(w, group_size=64, bits=bits)
    dq = mx.dequantize(wq, scales, biases, group_size=64, bits=bits)
    codes = mx.round((dq - mx.repeat(biases, 64, -1)) / mx.repeat(scales, 64, -1))
    assert mx.array_equal(pack(codes, bits), wq)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_output_is_what_mx_quantize_returns_and_dequantizes_to_the_fit(dtype):
    w = weights("heavy", (2, 48, 256)).astype(dtype)  # stacked, as MoE experts
    ref = mx.quantize(w, group_size=64, bits=4)
    wq, scales, biases = fit_affine(w, group_size=64, bits=4)
    for got, want in zip((wq, scales, biases), ref):
        assert got.shape == want.shape and got.dtype == want.dtype
    # The codes the fit chose, recovered from the packed words, give mx.dequantize's output.
    s, b = (mx.repeat(a.astype(mx.float32), 64, -1) for a in (scales, biases))
    codes = mx.clip(mx.round((w.astype(mx.float32) - b) / s), 0, 15)
    assert mx.array_equal(pack(codes, 4), wq)
    dq = mx.dequantize(wq, scales, biases, group_size=64, bits=4).astype(mx.float32)
    assert mx.allclose(dq, s * codes + b, atol=1e-3 if dtype == mx.float16 else 1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("rounding")
    src, _ = make_tiny(root / "hf", vocab_size=320)
    add_tokenizer(src)
    convert(src, root / "f32", dtype="float32")
    return root, src


def logits(path):
    model, _ = mlxinfer.load(path)
    return np.array(model(mx.array(IDS)).astype(mx.float32))


def test_mse_conversion_loads_runs_and_is_closer_to_float(tiny):
    root, src = tiny
    convert(src, root / "minmax", quantize=True, bits=4, dtype="float32")
    result = CliRunner().invoke(
        cli,
        ["convert", str(src), "-o", str(root / "mse"), "-q", "--bits", "4", "--rounding", "mse"],
    )
    assert result.exit_code == 0, result.output
    reference = logits(root / "f32")
    minmax, mse = logits(root / "minmax"), logits(root / "mse")
    assert np.isfinite(mse).all()
    assert np.mean((mse - reference) ** 2) < np.mean((minmax - reference) ** 2)


def test_gguf_source_refuses_mse_rounding_for_now(tmp_path):
    with pytest.raises(ConfigError, match="--rounding mse"):
        convert(tmp_path / "model.gguf", tmp_path / "out", quantize=True, rounding="mse")
