"""The compiled kernels against MLX's own ops (mx.quantized_matmul, x @ w.T).

Outside the main suite (pyproject's testpaths is tests/). Build first, then:
    python tools/build_kernels.py
    python -m pytest -q csrc/tests -p no:cacheprovider
The module is looked up in $MLXINFER_KERNELS_DIR, else build/kernels.
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, os.environ.get("MLXINFER_KERNELS_DIR", str(ROOT / "build" / "kernels")))

import mlx.core as mx  # noqa: E402

K = pytest.importorskip("_mlxinfer_kernels")

# SmolLM2-135M's projections (q/o 576->576, gate/up 576->1536, down 1536->576, head
# 576->49152) and odd sizes (N not a multiple of the 8-row blocks, K of 16).
SHAPES = [(576, 1536), (1536, 576), (576, 49152), (576, 576), (96, 13), (192, 1001), (1088, 7)]
ROWS = [1, 2, 3, 4, 5, 16]


def rel_err(y, ref):
    """max |y - ref| / max |ref|, in f32."""
    y, ref = y.astype(mx.float32), ref.astype(mx.float32)
    return (mx.abs(y - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-30)).item()


LEVELS = ["scalar", "avx2", "avx512"]


@pytest.fixture(params=LEVELS)
def path(request):
    """Each instruction-set path the CPU has (the level is capped, then restored)."""
    if LEVELS.index(request.param) > LEVELS.index(K.best_isa):
        pytest.skip(f"this CPU has no {request.param}")
    K.set_max_isa(request.param)
    assert K.isa() == request.param
    yield request.param
    K.set_max_isa("best")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("K_in,N", SHAPES)
def test_quantized_matches_mlx(path, bits, group_size, K_in, N):
    if K_in % group_size:
        pytest.skip("K not a multiple of the group size (mx.quantize refuses it too)")
    if path == "scalar" and N > 4096:
        pytest.skip("the scalar path is checked on the smaller shapes")
    mx.random.seed(K_in * 7 + N)
    w = mx.random.normal((N, K_in)) * 0.05
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    for m in ROWS if N <= 4096 else [1, 4]:
        x = mx.random.normal((m, K_in))
        ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group_size, bits=bits)
        y = K.quantized_matvec(x, wq, s, b, group_size, bits)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        assert rel_err(y, ref) <= 1e-4, (m, rel_err(y, ref))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_quantized_half_scales_and_inputs(dtype):
    mx.random.seed(1)
    w = (mx.random.normal((320, 256)) * 0.05).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    assert s.dtype == dtype
    # f32 x with half scales: f32 output.
    x = mx.random.normal((3, 256))
    ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4)
    y = K.quantized_matvec(x, wq, s, b, 64, 4)
    assert y.dtype == ref.dtype and rel_err(y, ref) <= 1e-4
    # half x: half output. MLX accumulates in the half type; we accumulate in f32, so the
    # reference is the same product in f32 and the tolerance is one output rounding
    # (2^-8 relative for bf16, 2^-11 for f16), with a factor 2 of headroom.
    xh = x.astype(dtype)
    f32 = mx.float32
    ref = mx.quantized_matmul(
        xh.astype(f32), wq, s.astype(f32), b.astype(f32), group_size=64, bits=4
    )
    y = K.quantized_matvec(xh, wq, s, b, 64, 4)
    eps = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
    assert y.dtype == dtype and rel_err(y, ref) <= 2 * eps
    mlx_own = mx.quantized_matmul(xh, wq, s, b, group_size=64, bits=4)
    assert rel_err(y, ref) <= rel_err(mlx_own, ref)


def test_quantized_batched_strided_and_compiled():
    mx.random.seed(2)
    w = mx.random.normal((256, 128))
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    x = mx.random.normal((2, 3, 128))
    ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=32, bits=4)
    assert rel_err(K.quantized_matvec(x, wq, s, b, 32, 4), ref) <= 1e-4
    xt = mx.random.normal((128, 3)).T  # a transposed view: not row-contiguous
    ref = mx.quantized_matmul(xt, wq, s, b, transpose=True, group_size=32, bits=4)
    assert rel_err(K.quantized_matvec(xt, wq, s, b, 32, 4), ref) <= 1e-4
    f = mx.compile(lambda x: K.quantized_matvec(x, wq, s, b, 32, 4) + 1.0)
    assert rel_err(f(x), mx.quantized_matmul(x, wq, s, b, group_size=32, bits=4) + 1.0) <= 1e-4


def test_threads_agree():
    """Rows are split between threads, never a row's sum: 1 and 2 threads agree exactly."""
    mx.random.seed(3)
    w = mx.random.normal((4096, 576))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((2, 576))
    before = K.num_threads()
    try:
        K.set_num_threads(1)
        y1 = K.quantized_matvec(x, wq, s, b, 64, 4)
        f1 = K.matvec(x, w)
        mx.eval(y1, f1)
        K.set_num_threads(2)
        assert K.num_threads() == 2
        y2 = K.quantized_matvec(x, wq, s, b, 64, 4)
        f2 = K.matvec(x, w)
        assert mx.array_equal(y1, y2).item() and mx.array_equal(f1, f2).item()
    finally:
        K.set_num_threads(before)


@pytest.mark.parametrize("K_in,N", SHAPES)
def test_f32_matvec_matches_mlx(path, K_in, N):
    mx.random.seed(K_in + N)
    w = mx.random.normal((N, K_in))
    for m in ROWS if N <= 4096 else [1, 4]:
        x = mx.random.normal((m, K_in))
        ref = x @ w.T
        assert rel_err(K.matvec(x, w), ref) <= 1e-4


@pytest.mark.parametrize(
    "args,match",
    [
        ((3, 32), "bits"),
        ((4, 16), "group_size"),
    ],
)
def test_bad_arguments_are_value_errors(args, match):
    w = mx.random.normal((64, 64))
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    with pytest.raises(ValueError, match=match):
        K.quantized_matvec(mx.zeros((1, 64)), wq, s, b, args[1], args[0])


def test_shape_mismatches_are_value_errors():
    w = mx.random.normal((64, 64))
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    with pytest.raises(ValueError, match="x: expected"):
        K.quantized_matvec(mx.zeros((1, 65)), wq, s, b, 32, 4)
    with pytest.raises(ValueError, match="scales/biases"):
        K.quantized_matvec(mx.zeros((1, 64)), wq, s[:, :1], b, 32, 4)
    with pytest.raises(ValueError, match="w: expected"):
        K.matvec(mx.zeros((1, 64)), w.astype(mx.float16))


def test_bad_isa_name():
    with pytest.raises(ValueError, match="set_max_isa"):
        K.set_max_isa("neon")


def test_version_recorded():
    assert K.mlx_version == mx.__version__.split(".dev")[0]


def test_two_streams_at_once():
    """Two MLX CPU streams (the backend's two-stream split) calling the kernels in one eval:
    the second caller finds the pool busy and runs inline; both results stay exact."""
    mx.random.seed(4)
    w = mx.random.normal((2048, 576))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    xs = [mx.random.normal((1, 576)) for _ in range(8)]
    streams = [mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)]
    before = K.num_threads()
    try:
        K.set_num_threads(2)
        outs = [
            K.quantized_matvec(x, wq, s, b, 64, 4, stream=streams[i % 2]) for i, x in enumerate(xs)
        ] + [K.matvec(x, w, stream=streams[i % 2]) for i, x in enumerate(xs)]
        mx.eval(outs)
    finally:
        K.set_num_threads(before)
    for x, y in zip(xs, outs[:8]):
        ref = mx.quantized_matmul(x, wq, s, b, group_size=64, bits=4)
        assert rel_err(y, ref) <= 1e-4
    for x, y in zip(xs, outs[8:]):
        assert rel_err(y, x @ w.T) <= 1e-4
