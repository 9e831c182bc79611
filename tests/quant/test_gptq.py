"""GPTQ rounding (Frantar et al. 2022) in MLX's affine format.

The blocked, Cholesky-factored implementation against the paper's algorithm written out plainly
here (float64, column by column, the inverse Hessian updated by removing each quantized column);
the output error it is built to reduce; the calibration pass's input covariances; a tiny model
converted with ``--rounding gptq``; and the one-line refusals.
"""

import json
import shutil
import tempfile

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from hf_models import add_tokenizer, make_tiny

import mlxinfer
from mlxinfer.cli.main import cli
from mlxinfer.errors import ConfigError
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model
from mlxinfer.quant.calibrate import calibrate
from mlxinfer.quant.covariances import CovarianceStore
from mlxinfer.quant.gptq import DAMP, gptq_quantize
from mlxinfer.quant.rounding import channel_weights, fit_affine


def correlated_inputs(rng, n, k, rho):
    """(n, k) inputs whose channels form an AR(1) chain: corr(x_i, x_j) = rho**|i - j|, with
    per-channel scales spread over a decade (as activations' are)."""
    x = np.empty((n, k))
    x[:, 0] = rng.normal(size=n)
    for j in range(1, k):
        x[:, j] = rho * x[:, j - 1] + np.sqrt(1 - rho**2) * rng.normal(size=n)
    return x * rng.uniform(0.3, 3.0, k)


def reference_gptq(w, h, group_size, bits, weights, scale_dtype):
    """The paper's algorithm, unblocked: quantize column j, spread its error over the later
    columns with the inverse Hessian's row j, then remove j from the inverse Hessian (the OBS
    update ``Hinv -= Hinv[:, j] Hinv[j, :] / Hinv[j, j]``). Each group's scale and bias are
    fitted (rounding.fit_affine) when its first column is reached. Returns codes (N, K) and
    per-group scales and biases (N, K / group_size), float64."""
    w = np.array(w, np.float64)
    n, k = w.shape
    hinv = np.linalg.inv(h + DAMP * np.mean(np.diag(h)) * np.eye(k))
    codes = np.zeros((n, k))
    scales = np.zeros((n, k // group_size))
    biases = np.zeros_like(scales)
    for j in range(k):
        g = j // group_size
        if j % group_size == 0:
            group = mx.array(w[:, j : j + group_size].astype(np.float32))
            v = None if weights is None else weights[:, j : j + group_size]
            _, s, b = fit_affine(
                group, group_size=group_size, bits=bits, weights=v, scale_dtype=scale_dtype
            )
            scales[:, g] = np.array(s.astype(mx.float32))[:, 0]
            biases[:, g] = np.array(b.astype(mx.float32))[:, 0]
        s, b = scales[:, g], biases[:, g]
        codes[:, j] = np.clip(np.round((w[:, j] - b) / s), 0, 2**bits - 1)
        error = (w[:, j] - (s * codes[:, j] + b)) / hinv[j, j]
        w[:, j + 1 :] -= np.outer(error, hinv[j, j + 1 :])
        hinv -= np.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return codes, scales, biases


def codes_of(wq, scales, biases, group_size, bits):
    """The codes MLX stores, read back through mx.dequantize: (dq - bias) / scale."""
    dq = np.array(mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits), np.float64)
    s = np.repeat(np.array(scales.astype(mx.float32), np.float64), group_size, -1)
    b = np.repeat(np.array(biases.astype(mx.float32), np.float64), group_size, -1)
    return np.round((dq - b) / s)


@pytest.mark.parametrize(
    "bits,group_size,block,weighted,dtype",
    [
        (4, 32, 64, True, mx.float16),  # 160 columns: the last block is partial
        (3, 64, 128, False, mx.float32),
        (2, 32, 32, True, mx.float32),
    ],
)
def test_blocked_cholesky_form_gives_the_papers_codes(bits, group_size, block, weighted, dtype):
    rng = np.random.default_rng(1)
    n, k = 24, 160 if group_size == 32 else 192
    x = correlated_inputs(rng, 400, k, 0.8)
    h = x.T @ x / len(x)
    w = mx.array(rng.normal(0, 0.05, (n, k)).astype(np.float32))
    v = channel_weights(np.diag(h).astype(np.float32), w.shape) if weighted else None
    wq, scales, biases = gptq_quantize(
        w, h, group_size=group_size, bits=bits, weights=v, scale_dtype=dtype, block=block
    )
    assert (wq.shape, scales.shape, scales.dtype) == (
        (n, k * bits // 32),
        (n, k // group_size),
        dtype,
    )
    want_codes, want_s, want_b = reference_gptq(w, h, group_size, bits, v, dtype)
    np.testing.assert_array_equal(codes_of(wq, scales, biases, group_size, bits), want_codes)
    np.testing.assert_allclose(np.array(scales.astype(mx.float32)), want_s, rtol=1e-6)
    np.testing.assert_allclose(np.array(biases.astype(mx.float32)), want_b, rtol=1e-6, atol=1e-9)


def output_error(w, fit, x, group_size, bits):
    dq = np.array(mx.dequantize(*fit, group_size=group_size, bits=bits), np.float64)
    return float(np.sum(((np.array(w, np.float64) - dq) @ x.T) ** 2))


@pytest.mark.parametrize("bits,group_size", [(4, 64), (3, 32)])
def test_output_error_is_far_below_per_weight_rounding_on_correlated_inputs(bits, group_size):
    """Why GPTQ must win here, and by how much.

    Rounding each weight alone leaves independent errors of variance s**2/12 (s the step), so
    ``E ||(W - Q) X||**2 = n_rows * s**2/12 * sum_j H_jj`` (H = X^T X). GPTQ's error on column
    j is compensated in the later columns as well as they can predict x_j; what is left is the
    part of x_j they cannot: ``E = n_rows * s**2/12 * sum_j L_jj**2`` with ``H = L L^T``
    (``L_jj**2`` = the variance of x_j not explained by x_{j+1..}). For an AR(1) chain with
    correlation rho, ``L_jj**2 = (1 - rho**2) H_jj`` for all but one column: a ratio of about
    1 - rho**2 = 0.19 at rho = 0.9. The bound asserted (0.5) leaves room for the grids, which
    GPTQ fits to weights its updates have moved.
    """
    rng = np.random.default_rng(0)
    x = correlated_inputs(rng, 2048, 256, 0.9)
    h = x.T @ x / len(x)
    w = mx.array(rng.normal(0, 0.05, (64, 256)).astype(np.float32))
    v = channel_weights(np.diag(h).astype(np.float32), w.shape)
    per_weight = fit_affine(w, group_size=group_size, bits=bits, weights=v)
    gptq = gptq_quantize(w, h, group_size=group_size, bits=bits, weights=v)
    ratio = output_error(w, gptq, x, group_size, bits) / output_error(
        w, per_weight, x, group_size, bits
    )
    assert ratio < 0.5, ratio


def test_uncorrelated_inputs_give_per_weight_rounding():
    """With H diagonal (independent channels) there is nothing to compensate: U is diagonal,
    each column's update is zero, so GPTQ's codes are the weighted fit's."""
    rng = np.random.default_rng(2)
    w = mx.array(rng.normal(0, 0.05, (16, 128)).astype(np.float32))
    h = np.diag(rng.uniform(0.5, 2.0, 128))
    v = channel_weights(np.diag(h).astype(np.float32), w.shape)
    got = gptq_quantize(w, h, group_size=64, bits=4, weights=v)
    want = fit_affine(w, group_size=64, bits=4, weights=v)
    for a, b in zip(got, want):
        assert mx.array_equal(a, b)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    src, _ = make_tiny(root / "hf", vocab_size=320, tie_word_embeddings=True)
    add_tokenizer(src)
    convert(src, root / "f32", dtype="float32")
    (root / "calib.txt").write_text(
        " ".join(f"word{i % 97} and number {i * 7 % 113}." for i in range(800))
    )
    return root


IDS = [[1, 5, 9, 2, 7, 300, 11, 4, 18, 6, 3, 250, 40, 41, 42, 17]]


def test_calibration_keeps_one_covariance_per_input(tiny):
    model, _ = load_model(tiny / "f32")
    stats = calibrate(model, IDS, covariance=True)
    inner = model.model
    x = inner.layers[0].input_layernorm(inner.embed_tokens(mx.array(IDS)))
    x = np.array(x, np.float64).reshape(-1, x.shape[-1])
    attn = [stats.covariances[f"model.layers.0.self_attn.{n}_proj"] for n in "qkv"]
    np.testing.assert_allclose(attn[0], x.T @ x / len(x), rtol=1e-4, atol=1e-6)
    assert attn[0] is attn[1] is attn[2]  # q, k, v read the same array: one H
    mlp = "model.layers.0.mlp"
    assert stats.covariances[f"{mlp}.gate_proj"] is stats.covariances[f"{mlp}.up_proj"]
    assert stats.covariances[f"{mlp}.down_proj"].shape == (model.args.intermediate_size,) * 2
    h = np.array(inner(mx.array(IDS)), np.float64).reshape(len(IDS[0]), -1)  # the tied head's
    np.testing.assert_allclose(
        stats.covariances["model.embed_tokens"], h.T @ h / len(h), rtol=1e-4, atol=1e-6
    )
    assert not calibrate(model, IDS).covariances  # only when asked for


def test_gptq_conversion_loads_and_runs(tiny):
    out = tiny / "gptq"
    # A named recipe: the plan without a probe per tensor (the calibration pass still runs).
    args = [
        "convert",
        str(tiny / "f32"),
        "-o",
        str(out),
        "--recipe",
        "q4_k_m",
        "--rounding",
        "gptq",
    ]
    result = CliRunner().invoke(cli, [*args, "--calibration", str(tiny / "calib.txt")])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "config.json").read_text())["quantization"]
    assert record["model.layers.0.self_attn.q_proj"] == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
    }
    model, tokenizer = mlxinfer.load(out)
    logits = np.array(model(mx.array(IDS)))
    assert logits.shape == (1, len(IDS[0]), 320) and np.isfinite(logits).all()
    reference = np.array(load_model(tiny / "f32")[0](mx.array(IDS)))
    assert np.mean((logits - reference) ** 2) < 0.25 * np.mean(reference**2)  # 0.11 here


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(quantize=True, bits=4), "--rounding gptq needs a calibration pass"),
        (dict(quantize=True), "--dtype (a GGUF without --dtype keeps its own grids)"),
    ],
)
def test_gptq_without_a_calibration_pass_is_one_line(tmp_path, kwargs, message):
    src = tmp_path / "model.gguf" if "bits" not in kwargs else tmp_path / "hf"
    with pytest.raises(ConfigError) as e:
        convert(src, tmp_path / "out", rounding="gptq", **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(
        cli,
        ["convert", str(src), "-o", str(tmp_path / "out"), "-q", "--rounding", "gptq"]
        + (["--bits", "4"] if "bits" in kwargs else []),
    )
    assert result.exit_code != 0 and message in result.output


def _layerwise(model, ids, **kwargs):
    """``layerwise.calibrate`` with the model's own arrays as the "fresh" loads."""
    from mlx.utils import tree_flatten

    from mlxinfer.quant import layerwise

    resident = layerwise.Resident(model, lambda: dict(tree_flatten(model.parameters())))
    return layerwise.calibrate(model, ids, resident, covariance=True, **kwargs)


def test_the_layer_by_layer_pass_keeps_the_covariances_on_disk(tiny):
    """The same means as the in-memory pass, memory-mapped from the store's files (one per
    input, shared by its readers); the files are gone once the store is closed."""
    model, _ = load_model(tiny / "f32")
    want = calibrate(model, IDS, covariance=True).covariances
    got = _layerwise(model, IDS).covariances
    assert isinstance(got, CovarianceStore) and sorted(got) == sorted(want)
    for path in want:
        assert isinstance(got[path], np.memmap) and str(got[path].filename).startswith(str(got.dir))
        np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-7)
    attn = [got[f"model.layers.0.self_attn.{n}_proj"] for n in "qkv"]
    assert attn[0] is attn[1] is attn[2]
    # A block's four inputs (q/k/v's, o's, gate/up's, down's) and the tied head's.
    files = len({id(got[p]) for p in got})
    assert len(list(got.dir.iterdir())) == files == 4 * model.args.num_hidden_layers + 1
    got.close()
    assert not got.dir.exists()


def test_each_block_goes_to_disk_once_evaluated(tiny, monkeypatch):
    """Memory holds one block's sums of x x^T at a time: every spill's sums are from one block
    (or the head's input), and every block's are spilled (kept to the end, a 70B model's
    would be 330 GB)."""
    from mlxinfer.quant.calibrate import _Recorder

    spilled: list[set[str]] = []
    original = _Recorder.spill

    def spill(self):
        spilled.append({p.split(".self_attn")[0].split(".mlp")[0] for p in self.xtx})
        original(self)

    monkeypatch.setattr(_Recorder, "spill", spill)
    model, _ = load_model(tiny / "f32")
    stats = _layerwise(model, IDS)
    n = model.args.num_hidden_layers
    assert [s for s in spilled if s] == [{f"model.layers.{i}"} for i in range(n)] + [
        {"model.embed_tokens"}
    ]
    stats.covariances.close()


def test_too_little_temporary_space_is_one_line(tiny, monkeypatch, tmp_path):
    from mlxinfer.quant import covariances

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(
        covariances.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1, 1, 100)
    )
    model, _ = load_model(tiny / "f32")
    with pytest.raises(ConfigError) as e:
        _layerwise(model, IDS)
    message = str(e.value)
    assert "\n" not in message and "model.layers.0.self_attn.q_proj" in message
    assert "100 free" in message and "TMPDIR" in message and "--rounding mse" in message
    assert not list(tmp_path.iterdir())  # the store's folder removed


def test_a_gptq_conversion_leaves_no_covariance_files(tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    convert(
        tiny / "f32",
        tmp_path / "out",
        recipe="q4_k_m",
        rounding="gptq",
        calibration=str(tiny / "calib.txt"),
    )
    assert (tmp_path / "out" / "config.json").is_file()
    assert not list(tmp_path.glob("mlxinfer-covariances-*"))
