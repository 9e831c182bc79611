"""The compiled CPU kernels (csrc/, ``mlxinfer.backends.kernels``) against MLX's own ops
(``mx.quantized_matmul``, ``x @ w.T``), and how their absence is reported.

``pip install -e .`` builds them (setup.py); ``python tools/build_kernels.py`` builds them
into a checkout's build/kernels. Where they are not built these tests skip with the reason,
except under ``MLXINFER_REQUIRE_KERNELS=1`` (CI), where that is an error. The suite runs a
representative subset (every instruction-set path this CPU has, bits 2, 3, 4, 5, 6 and 8,
group sizes 32/64/128, 1/4/16 rows, SmolLM2-135M's shapes and an odd one; MLX's float modes
mxfp4, nvfp4 and mxfp8); ``MLXINFER_SLOW=1`` runs the whole matrix.
"""

import os

import mlx.core as mx
import numpy as np
import pytest

from mlxinfer.backends import kernels

K = kernels.load()
REQUIRE = "MLXINFER_REQUIRE_KERNELS"
SLOW = pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="the whole shape x bits x group x rows x ISA matrix: set MLXINFER_SLOW=1 to run",
)

# SmolLM2-135M's projections (gate/up 576->1536, down 1536->576, q/o 576->576, head
# 576->49152) and odd sizes (N not a multiple of the 8-row blocks, K of 16).
SMOLLM2 = [(576, 1536), (1536, 576), (576, 576)]
HEAD = (576, 49152)
ODD = [(96, 13), (192, 1001), (1088, 7), (384, 1001)]
LEVELS = ["scalar", "avx2", "avx512"]


@pytest.fixture(scope="module")
def k():
    """The kernels' module; a skip naming why it is absent (an error under CI's REQUIRE)."""
    if K is None:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but {kernels.reason()}", pytrace=False)
        pytest.skip(kernels.reason())
    return K


def paths(k) -> list[str]:
    """Each instruction-set path this CPU has (arm64: scalar and neon)."""
    levels = ["scalar", "neon"] if k.best_isa == "neon" else LEVELS
    return levels[: levels.index(k.best_isa) + 1]


def rel_err(y, ref):
    """max |y - ref| / max |ref|, in f32."""
    y, ref = y.astype(mx.float32), ref.astype(mx.float32)
    return (mx.abs(y - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-30)).item()


def check_quantized(k, K_in, N, bits, group_size, rows, levels):
    mx.random.seed(K_in * 7 + N)
    w = mx.random.normal((N, K_in)) * 0.05
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    for m in rows:
        x = mx.random.normal((m, K_in))
        ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group_size, bits=bits)
        try:
            for level in levels:
                k.set_max_isa(level)
                assert k.isa() == level
                y = k.quantized_matvec(x, wq, s, b, group_size, bits)
                assert y.shape == ref.shape and y.dtype == ref.dtype
                assert rel_err(y, ref) <= 1e-4, (level, m, rel_err(y, ref))
        finally:
            k.set_max_isa("best")


def check_f32(k, K_in, N, rows, levels):
    mx.random.seed(K_in + N)
    w = mx.random.normal((N, K_in))
    for m in rows:
        x = mx.random.normal((m, K_in))
        ref = x @ w.T
        try:
            for level in levels:
                k.set_max_isa(level)
                assert rel_err(k.matvec(x, w), ref) <= 1e-4, (level, m)
        finally:
            k.set_max_isa("best")


# One output rounding of each dtype (2^-8 relative for bf16, 2^-11 for f16), with a factor 2.
ROUNDING = {mx.float32: 0.0, mx.bfloat16: 2 * 2.0**-8, mx.float16: 2 * 2.0**-11}


def check_half(k, K_in, N, wdtype, rows, levels, xdtypes=(mx.float32,), scale=1.0):
    """``K.matvec`` with bf16 / f16 weights against the product in f32 of the same values
    (the kernel widens them exactly and accumulates in f32): within 1e-4 of the largest, plus
    one rounding of the output dtype, which is ``x @ w.T``'s (promote_types(x, w))."""
    mx.random.seed(K_in * 3 + N)
    w = (mx.random.normal((N, K_in)) * scale).astype(wdtype)
    for xdtype in xdtypes:
        for m in rows:
            x = mx.random.normal((m, K_in)).astype(xdtype)
            ref = x.astype(mx.float32) @ w.astype(mx.float32).T
            dtype = (x[:1] @ w[:1].T).dtype  # MLX's own output dtype for these inputs
            try:
                for level in levels:
                    k.set_max_isa(level)
                    y = k.matvec(x, w)
                    assert y.shape == ref.shape and y.dtype == dtype, (level, y.dtype, dtype)
                    err = rel_err(y, ref)
                    assert err <= 1e-4 + ROUNDING[dtype], (level, xdtype, m, err)
            finally:
                k.set_max_isa("best")


# Each 4/8 bits x group size once, on the SmolLM2 shapes and an odd one in turn (the LM head,
# 576 -> 49152, takes seconds to set up: in the slow matrix only); the bit-stream widths
# (2/3/5/6, whose 3/5/6-bit codes straddle words) each once, every group size among them,
# small shapes with K off the 128-code blocks and N off the 2-row passes.
SUITE = [
    (4, 32, 576, 1536),
    (4, 64, 1536, 576),
    (4, 128, 384, 1001),
    (8, 32, 576, 576),
    (8, 64, 576, 1536),
    (8, 128, 1536, 576),
    (2, 64, 576, 131),
    (3, 32, 96, 13),
    (5, 128, 384, 77),
    (6, 32, 576, 33),
]
BITS = [2, 3, 4, 5, 6, 8]


@pytest.mark.parametrize("bits,group_size,K_in,N", SUITE)
def test_quantized_matches_mlx(k, bits, group_size, K_in, N):
    check_quantized(k, K_in, N, bits, group_size, [1, 4, 16], paths(k))


# MLX's float modes: (bits, group size) of mx.quantize's only setting for each; uint8 scales
# (E8M0 for the mx modes, E4M3 for nvfp4), no biases; E2M1 codes for the fp4 modes, E4M3 for
# mxfp8.
FLOAT_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


def dequantized_product(x, wq, s, mode):
    """x @ mx.dequantize(w).T in float64 (numpy): a reference apart from quantized_matmul."""
    w = np.array(mx.dequantize(wq, s, None, mode=mode, dtype=mx.float32), dtype=np.float64)
    return mx.array((np.array(x.astype(mx.float32), dtype=np.float64) @ w.T).astype(np.float32))


def check_float_mode(k, mode, K_in, N, rows, levels):
    """A float mode against MLX's product and against x @ dequantize(w).T in float64: f32 x
    within 1e-4 of the largest; bf16 x gives bf16 (MLX's dtype) within one rounding of the f32
    product."""
    bits, gs = FLOAT_MODES[mode]
    mx.random.seed(K_in * 5 + N + bits)
    w = mx.random.normal((N, K_in)) * 0.05
    wq, s = mx.quantize(w, mode=mode)
    for m in rows:
        x = mx.random.normal((m, K_in))
        ref = mx.quantized_matmul(x, wq, s, None, transpose=True, mode=mode)
        assert rel_err(ref, dequantized_product(x, wq, s, mode)) <= 1e-5  # the two references
        xb = x.astype(mx.bfloat16)
        ref_b = mx.quantized_matmul(xb.astype(mx.float32), wq, s, None, mode=mode)
        try:
            for level in levels:
                k.set_max_isa(level)
                y = k.quantized_matvec(x, wq, s, None, gs, bits, mode=mode)
                assert y.shape == ref.shape and y.dtype == ref.dtype == mx.float32
                assert rel_err(y, ref) <= 1e-4, (level, m, rel_err(y, ref))
                yb = k.quantized_matvec(xb, wq, s, None, gs, bits, mode=mode)
                assert yb.dtype == mx.bfloat16 and rel_err(yb, ref_b) <= 2 * 2.0**-8, (level, m)
        finally:
            k.set_max_isa("best")


@pytest.mark.parametrize(
    "mode,K_in,N,rows",
    [
        ("mxfp4", 576, 1536, [1, 4, 16]),
        ("mxfp4", 96, 13, [1, 2, 5, 9]),
        ("nvfp4", 576, 1536, [1, 4, 16]),
        ("nvfp4", 96, 13, [1, 2, 5, 9]),
        ("nvfp4", 80, 12, [1, 3]),  # K off a multiple of 32: AVX-512 takes AVX2's 16-code steps
        ("mxfp8", 576, 1536, [1, 4, 16]),
        ("mxfp8", 96, 13, [1, 2, 5, 9]),
    ],
)
def test_float_modes_match_mlx(k, mode, K_in, N, rows):
    check_float_mode(k, mode, K_in, N, rows, paths(k))


@SLOW
@pytest.mark.slow
@pytest.mark.parametrize("mode", list(FLOAT_MODES))
@pytest.mark.parametrize("K_in,N", [*SMOLLM2, HEAD, *ODD])
def test_float_modes_matrix(k, mode, K_in, N):
    big = N > 4096
    levels = paths(k)[1:] if big else paths(k)
    check_float_mode(k, mode, K_in, N, [1, 4] if big else [1, 2, 3, 4, 5, 16], levels)


def test_every_e4m3_byte_as_mlx_decodes_it(k):
    """mxfp8's codes and nvfp4's scales take every byte as MLX does (subnormals, both signs,
    NaN for 0x7F and 0xFF): row n of each holds byte n everywhere, on every path."""
    n = np.arange(256, dtype=np.uint8)
    x = mx.random.normal((1, 32))
    mx8 = mx.array(np.repeat(n[:, None], 32, 1).view(np.uint32)), mx.full((256, 1), 127, mx.uint8)
    nv4 = mx.full((256, 4), 0x76543210, mx.uint32), mx.array(np.repeat(n[:, None], 2, 1))
    for mode, (wq, s) in [("mxfp8", mx8), ("nvfp4", nv4)]:
        bits, gs = FLOAT_MODES[mode]
        ref = np.array(mx.quantized_matmul(x, wq, s, None, mode=mode))
        assert (
            np.isnan(ref[0, [0x7F, 0xFF]]).all() and np.isfinite(np.delete(ref, [0x7F, 0xFF])).all()
        )
        try:
            for level in paths(k):
                k.set_max_isa(level)
                y = np.array(k.quantized_matvec(x, wq, s, None, gs, bits, mode=mode))
                np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-30, err_msg=f"{mode} {level}")
        finally:
            k.set_max_isa("best")


@pytest.mark.parametrize("mode", list(FLOAT_MODES))
def test_float_modes_row_blocks_and_threads(k, mode):
    """The float modes' scales are decoded per block of 64 rows as the rows run: 1000 rows (a
    partial last block) agree with MLX, and 1 and 2 threads give identical bits."""
    bits, gs = FLOAT_MODES[mode]
    mx.random.seed(6)
    wq, s = mx.quantize(mx.random.normal((1000, 576)) * 0.05, mode=mode)
    x = mx.random.normal((3, 576))
    ref = mx.quantized_matmul(x, wq, s, None, mode=mode)
    before = k.num_threads()
    try:
        k.set_num_threads(1)
        y1 = k.quantized_matvec(x, wq, s, None, gs, bits, mode=mode)
        mx.eval(y1)
        k.set_num_threads(2)
        y2 = k.quantized_matvec(x, wq, s, None, gs, bits, mode=mode)
        assert mx.array_equal(y1, y2).item() and rel_err(y1, ref) <= 1e-4
    finally:
        k.set_num_threads(before)


@pytest.mark.parametrize("mode", list(FLOAT_MODES))
def test_float_mode_bad_arguments_are_value_errors(k, mode):
    bits, gs = FLOAT_MODES[mode]
    w = mx.random.normal((64, 64))
    wq, s = mx.quantize(w, mode=mode)
    _, s_aff, b_aff = mx.quantize(w, group_size=32, bits=bits)
    x = mx.zeros((1, 64))
    cases = [
        (dict(biases=b_aff), "biases"),  # the float modes have none
        (dict(group_size=64), "group_size"),
        (dict(bits=8 if bits == 4 else 4), "bits"),
        (dict(mode="mxfp6"), "mode"),
        (dict(scales=s_aff), "scales"),  # float scales: not E8M0 / E4M3
    ]
    for change, match in cases:
        a = dict(scales=s, biases=None, group_size=gs, bits=bits, mode=mode) | change
        with pytest.raises(ValueError, match=match):
            k.quantized_matvec(
                x, wq, a["scales"], a["biases"], a["group_size"], a["bits"], mode=a["mode"]
            )
    with pytest.raises(ValueError, match="biases"):  # affine needs them
        k.quantized_matvec(x, wq, s_aff, None, 32, bits)


@pytest.mark.parametrize("K_in,N", [(576, 1536), (1536, 576), (1088, 7)])
def test_f32_matvec_matches_mlx(k, K_in, N):
    check_f32(k, K_in, N, [1, 4, 16], paths(k))


# bf16 / f16 weights: a SmolLM2 shape, and odd ones (N not a multiple of the 4-row blocks, K
# with a tail past the last 16 / 32 weights: the scalar remainder, x's de-interleaving).
HALF = [
    (mx.bfloat16, 576, 1536),
    (mx.float16, 1088, 7),
    (mx.bfloat16, 100, 13),
    (mx.float16, 37, 5),
]


@pytest.mark.parametrize("wdtype,K_in,N", HALF, ids=lambda v: str(v).split(".")[-1])
def test_half_weight_matvec_matches_f32(k, wdtype, K_in, N):
    rows = [1, 4, 16] if N > 1000 else [1, 2, 5, 16]
    xdtypes = (mx.float32, wdtype) if N > 1000 else (mx.float32, mx.bfloat16, mx.float16)
    check_half(k, K_in, N, wdtype, rows, paths(k), xdtypes)


def test_f16_subnormal_and_large_weights(k):
    """f16 weights below the normal range (2^-14) and near its top, widened exactly on every
    path (the scalar widening handles subnormals apart)."""
    check_half(k, 200, 24, mx.float16, [1, 3], paths(k), scale=1e-5)
    check_half(k, 200, 24, mx.float16, [1, 3], paths(k), scale=1e4)


@SLOW
@pytest.mark.slow
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("K_in,N", [*SMOLLM2, HEAD, *ODD])
def test_quantized_matrix(k, bits, group_size, K_in, N):
    if K_in % group_size:
        pytest.skip("K not a multiple of the group size (mx.quantize refuses it too)")
    big = N > 4096
    levels = paths(k)[1:] if big else paths(k)  # the scalar path on the smaller shapes
    check_quantized(k, K_in, N, bits, group_size, [1, 4] if big else [1, 2, 3, 4, 5, 16], levels)


@SLOW
@pytest.mark.slow
@pytest.mark.parametrize("K_in,N", [*SMOLLM2, HEAD, *ODD])
def test_f32_matrix(k, K_in, N):
    check_f32(k, K_in, N, [1, 4] if N > 4096 else [1, 2, 3, 4, 5, 16], paths(k))


@SLOW
@pytest.mark.slow
@pytest.mark.parametrize("wdtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("K_in,N", [*SMOLLM2, HEAD, *ODD, (100, 13), (37, 5)])
def test_half_weight_matrix(k, wdtype, K_in, N):
    big = N > 4096
    levels = paths(k)[1:] if big else paths(k)
    rows = [1, 4] if big else [1, 2, 3, 4, 5, 16]
    check_half(k, K_in, N, wdtype, rows, levels, (mx.float32, mx.bfloat16, mx.float16))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_quantized_half_scales_and_inputs(k, dtype):
    mx.random.seed(1)
    w = (mx.random.normal((320, 256)) * 0.05).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    assert s.dtype == dtype
    # f32 x with half scales: f32 output.
    x = mx.random.normal((3, 256))
    ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4)
    y = k.quantized_matvec(x, wq, s, b, 64, 4)
    assert y.dtype == ref.dtype and rel_err(y, ref) <= 1e-4
    # half x: half output. MLX accumulates in the half type; we accumulate in f32, so the
    # reference is the same product in f32 and the tolerance is one output rounding
    # (2^-8 relative for bf16, 2^-11 for f16), with a factor 2 of headroom.
    xh = x.astype(dtype)
    f32 = mx.float32
    ref = mx.quantized_matmul(
        xh.astype(f32), wq, s.astype(f32), b.astype(f32), group_size=64, bits=4
    )
    y = k.quantized_matvec(xh, wq, s, b, 64, 4)
    eps = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
    assert y.dtype == dtype and rel_err(y, ref) <= 2 * eps
    mlx_own = mx.quantized_matmul(xh, wq, s, b, group_size=64, bits=4)
    assert rel_err(y, ref) <= rel_err(mlx_own, ref)


def test_quantized_batched_strided_and_compiled(k):
    mx.random.seed(2)
    w = mx.random.normal((256, 128))
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    x = mx.random.normal((2, 3, 128))
    ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=32, bits=4)
    assert rel_err(k.quantized_matvec(x, wq, s, b, 32, 4), ref) <= 1e-4
    xt = mx.random.normal((128, 3)).T  # a transposed view: not row-contiguous
    ref = mx.quantized_matmul(xt, wq, s, b, transpose=True, group_size=32, bits=4)
    assert rel_err(k.quantized_matvec(xt, wq, s, b, 32, 4), ref) <= 1e-4
    f = mx.compile(lambda x: k.quantized_matvec(x, wq, s, b, 32, 4) + 1.0)
    assert rel_err(f(x), mx.quantized_matmul(x, wq, s, b, group_size=32, bits=4) + 1.0) <= 1e-4


def test_half_weights_batched_strided_compiled_and_threaded(k):
    mx.random.seed(5)
    w = mx.random.normal((1000, 96)).astype(mx.bfloat16)
    f32 = mx.float32

    def ref(x, w):
        return x.astype(f32) @ w.astype(f32).T

    x = mx.random.normal((2, 3, 96)).astype(mx.bfloat16)  # batched: bf16 out
    y = k.matvec(x, w)
    assert y.shape == (2, 3, 1000) and y.dtype == mx.bfloat16
    assert rel_err(y, ref(x, w)) <= 1e-4 + ROUNDING[mx.bfloat16]
    wt = mx.random.normal((96, 40)).astype(mx.float16).T  # a transposed view: not row-contiguous
    assert rel_err(k.matvec(x[0].astype(f32), wt), ref(x[0], wt)) <= 1e-4
    f = mx.compile(lambda x: k.matvec(x, w) + 1.0)
    assert rel_err(f(x[0].astype(f32)), ref(x[0], w) + 1.0) <= 1e-4
    # rows split between threads, never a row's sum: 1 and 2 threads agree exactly
    big = mx.random.normal((4096, 576)).astype(mx.bfloat16)
    x1 = mx.random.normal((1, 576))
    before = k.num_threads()
    try:
        k.set_num_threads(1)
        y1 = k.matvec(x1, big)
        mx.eval(y1)
        k.set_num_threads(2)
        assert mx.array_equal(y1, k.matvec(x1, big)).item()
    finally:
        k.set_num_threads(before)


def test_threads_agree(k):
    """Rows are split between threads, never a row's sum: 1 and 2 threads agree exactly."""
    mx.random.seed(3)
    w = mx.random.normal((4096, 576))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((2, 576))
    before = k.num_threads()
    try:
        k.set_num_threads(1)
        y1 = k.quantized_matvec(x, wq, s, b, 64, 4)
        f1 = k.matvec(x, w)
        mx.eval(y1, f1)
        k.set_num_threads(2)
        assert k.num_threads() == 2
        y2 = k.quantized_matvec(x, wq, s, b, 64, 4)
        f2 = k.matvec(x, w)
        assert mx.array_equal(y1, y2).item() and mx.array_equal(f1, f2).item()
    finally:
        k.set_num_threads(before)


def test_two_streams_at_once(k):
    """Two MLX CPU streams (the backend's two-stream split) calling the kernels in one eval:
    the second caller finds the pool busy and runs inline; both results stay exact."""
    mx.random.seed(4)
    w = mx.random.normal((2048, 576))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    xs = [mx.random.normal((1, 576)) for _ in range(8)]
    streams = [mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)]
    before = k.num_threads()
    try:
        k.set_num_threads(2)
        outs = [
            k.quantized_matvec(x, wq, s, b, 64, 4, stream=streams[i % 2]) for i, x in enumerate(xs)
        ] + [k.matvec(x, w, stream=streams[i % 2]) for i, x in enumerate(xs)]
        mx.eval(outs)
    finally:
        k.set_num_threads(before)
    for x, y in zip(xs, outs[:8]):
        assert rel_err(y, mx.quantized_matmul(x, wq, s, b, group_size=64, bits=4)) <= 1e-4
    for x, y in zip(xs, outs[8:]):
        assert rel_err(y, x @ w.T) <= 1e-4


@pytest.mark.parametrize("bits,group_size,match", [(7, 32, "bits"), (4, 16, "group_size")])
def test_bad_arguments_are_value_errors(k, bits, group_size, match):
    w = mx.random.normal((64, 64))
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    with pytest.raises(ValueError, match=match):
        k.quantized_matvec(mx.zeros((1, 64)), wq, s, b, group_size, bits)


def test_shape_mismatches_are_value_errors(k):
    w = mx.random.normal((64, 64))
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    with pytest.raises(ValueError, match="x: expected"):
        k.quantized_matvec(mx.zeros((1, 65)), wq, s, b, 32, 4)
    with pytest.raises(ValueError, match="w: expected"):  # 8 words a row: no whole 3-bit row
        k.quantized_matvec(mx.zeros((1, 64)), wq, s, b, 32, 3)
    with pytest.raises(ValueError, match="scales/biases"):
        k.quantized_matvec(mx.zeros((1, 64)), wq, s[:, :1], b, 32, 4)
    with pytest.raises(ValueError, match="w: expected"):
        k.matvec(mx.zeros((1, 64)), w.astype(mx.int32))
    with pytest.raises(ValueError, match="w: expected"):
        k.matvec(mx.zeros((1, 64)), w.astype(mx.bfloat16)[None])
    with pytest.raises(ValueError, match="set_max_isa"):  # the other architecture's level
        k.set_max_isa("avx2" if k.best_isa == "neon" else "neon")


def test_version_recorded(k):
    assert k.mlx_version == mx.__version__.split(".dev")[0]
    assert kernels.describe().startswith(
        f"kernels: {kernels.level(k)} on {k.num_threads()} threads"
    )


# Loading: what load() and reason() say where the module is absent, off or refuses this MLX.


@pytest.fixture
def fresh(monkeypatch):
    """kernels.load() re-run in the test (its result restored after)."""
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.delenv(kernels.ENV, raising=False)
    return monkeypatch


def test_a_version_mismatch_is_none_and_a_reason_naming_both(fresh, tmp_path):
    """The module's own import refusal (bindings.cpp), as a build for another MLX raises it."""
    fake = tmp_path / "_mlxinfer_kernels.cpython-311-x86_64-linux-gnu.so"
    message = (
        f"_mlxinfer_kernels: built for MLX 0.0.0, found MLX {mx.__version__}; "
        "reinstall mlxinfer (pip install) or rebuild with tools/build_kernels.py"
    )

    def refuse(path):
        assert path == fake
        raise ImportError(message)

    fresh.setattr(kernels, "_find", lambda: fake)
    fresh.setattr(kernels, "_import", refuse)
    assert kernels.load() is None
    why = kernels.reason()
    assert "0.0.0" in why and mx.__version__ in why and str(fake) in why
    assert kernels.describe() == why and "\n" not in why


def test_off_and_not_built_are_reasons(fresh, tmp_path):
    fresh.setenv(kernels.ENV, "0")
    assert kernels.load() is None and "MLXINFER_KERNELS=0" in kernels.reason()
    fresh.setattr(kernels, "_loaded", None)
    fresh.delenv(kernels.ENV)
    fresh.setattr(kernels, "_find", lambda: None)
    assert kernels.load() is None and "not built" in kernels.reason()


def test_the_installs_note_is_the_reason(fresh, tmp_path):
    """setup.py leaves its one line beside the package when it could not build them."""
    note = tmp_path / "kernels" / kernels.NOT_BUILT
    note.parent.mkdir()
    note.write_text("kernels not built at install (cmake not found on PATH)\n")
    fresh.setattr(kernels, "__file__", str(note.parent / "__init__.py"))
    fresh.setattr(kernels, "_find", lambda: None)
    assert kernels.load() is None
    assert kernels.reason() == (
        "kernels not built at install (cmake not found on PATH); MLX's own ops are used"
    )


def test_quantized_every_row_count_of_a_batched_step(k):
    """Batched decode's row counts 2..9 (the passes of 8 rows and each remainder) against
    MLX's quantized product, on each instruction-set path."""
    check_quantized(k, 576, 576, 4, 32, [2, 3, 5, 6, 7, 8, 9], paths(k))
    check_quantized(k, 576, 200, 8, 64, [3, 8], paths(k))
    # the bit-stream widths' dequantizing passes (x read unscaled, the scale takes the 2^-s)
    check_quantized(k, 192, 37, 3, 64, [2, 5, 8, 9], paths(k))
    check_quantized(k, 160, 21, 6, 32, [3, 7], paths(k))


def test_quantized_long_rows_and_both_several_row_loops(k):
    """Rows longer than 768 (AVX-512 runs them in passes of 4 x rows, 5 rows left as one pass)
    at 2..16 rows against MLX's product on each path, and AVX-512's earlier loops
    (``set_qmv_rows_path(0)``, kept for benchmarks: several rows, one row of 8-bit codes; and
    AVX2's one row of 8-bit codes) against the default ones."""
    check_quantized(k, 1536, 37, 4, 32, [2, 4, 5, 6, 8, 9, 13, 16], paths(k))
    check_quantized(k, 1536, 21, 3, 64, [5, 9], paths(k))
    if not hasattr(k, "set_qmv_rows_path"):  # a module built before it
        return
    mx.random.seed(3)
    wq, s, b = mx.quantize(mx.random.normal((40, 1536)) * 0.05, group_size=32, bits=8)
    cases = [(r, K_in) for r in (1, 8, 13, 16) for K_in in (576, 1536)]
    for level in [p for p in paths(k) if p in ("avx2", "avx512")]:
        for rows, K_in in cases:
            x = mx.random.normal((rows, K_in))
            w = (wq, s, b) if K_in == 1536 else (wq[:, :144], s[:, :18], b[:, :18])
            try:
                k.set_max_isa(level)
                k.set_qmv_rows_path(0)
                before = k.quantized_matvec(x, *w, 32, 8)
                k.set_qmv_rows_path(1)
                after = k.quantized_matvec(x, *w, 32, 8)
            finally:
                k.set_qmv_rows_path(1)
                k.set_max_isa("best")
            assert rel_err(after, before) <= 1e-5, (level, rows, K_in)


def test_one_row_loops_one_or_two_output_rows_a_pass(k):
    """AVX-512's one-row loops run one output row a pass from 1,024 codes a row (and for 8-bit
    codes) and two below: every width at a short and a long row, an odd row count (the pass's
    remainder), with the choice by length and each forced, against MLX's product."""
    if "avx512" not in paths(k) or not hasattr(k, "set_qmv_decode_rows"):
        pytest.skip("AVX-512's one-row loops: this CPU or module has none")
    for bits in BITS:
        for K_in, group_size in ((576, 32), (1536, 64)):
            mx.random.seed(bits * 31 + K_in)
            wq, s, b = mx.quantize(
                mx.random.normal((37, K_in)) * 0.05, group_size=group_size, bits=bits
            )
            x = mx.random.normal((1, K_in))
            ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group_size, bits=bits)
            try:
                for rows in (0, 1, 2):
                    k.set_qmv_decode_rows(rows)
                    y = k.quantized_matvec(x, wq, s, b, group_size, bits)
                    assert rel_err(y, ref) <= 1e-5, (bits, K_in, rows)
            finally:
                k.set_qmv_decode_rows(0)


def test_log_softmax_matches_float64(k):
    """Log-probs of a few rows of logits against the float64 computation (numpy), within
    2e-5 (relative past 1; MLX's own f32 logsumexp was 5e-5 off on the vocabulary-sized rows):
    a vocabulary-sized row, a length off the 16-lane blocks, -inf logits, bf16 input, a
    transposed view."""
    import numpy as np

    def ref(x):
        x = np.asarray(x.astype(mx.float32), np.float64)
        top = x.max(-1, keepdims=True)
        return x - (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))

    mx.random.seed(7)
    cases = [
        mx.random.normal((3, 49152)) * 8,
        mx.random.normal((2, 37)),
        mx.array([[0.0, -float("inf"), 3.0, -1e4]]),
        mx.random.normal((2, 100)).astype(mx.bfloat16),
        mx.random.normal((40, 3)).T,  # f32 through a transposed view: converted, not read in place
    ]
    try:
        for level in paths(k):
            k.set_max_isa(level)
            for x in cases:
                y = k.log_softmax(x)
                assert y.dtype == mx.float32 and y.shape == x.shape
                expected = ref(x)
                got = np.asarray(y, np.float64)
                assert np.array_equal(np.isinf(got), np.isinf(expected)), level
                finite = np.isfinite(expected)
                got, expected = got[finite], expected[finite]  # (-inf - -inf: no error to take)
                err = np.abs(got - expected) / np.maximum(1.0, np.abs(expected))
                assert err.max() <= 2e-5, (level, x.shape)
    finally:
        k.set_max_isa("best")


def test_log_softmax_argmax_gives_mlxs_argmax_and_the_same_log_probs(k):
    """``K.log_softmax_argmax`` (the batching engine's greedy token and log-probs in one pass):
    the index ``mx.argmax`` and ``np.argmax`` give (ties to the first, the first NaN where a row
    has one) on ties, NaNs, infinities, 8 vocabulary-sized rows on two threads, bf16 and a
    transposed view; its log-probs the same bits as ``K.log_softmax``."""
    import numpy as np

    def rule(x):
        return np.argmax(np.asarray(x.astype(mx.float32)), axis=-1).tolist()

    nan, inf = float("nan"), float("inf")
    mx.random.seed(11)
    rows = np.random.default_rng(11).normal(size=(2, 1000)).astype(np.float32)
    rows[0, [700, 900]] = nan
    rows[0, 950] = 60.0  # the largest after the NaNs: a scan for it would pass them
    rows[1, [37, 600]] = 50.0
    long_rows = mx.array(rows)
    cases = [
        mx.random.normal((8, 49152)) * 8,
        mx.array([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]]),  # ties: the first
        mx.array([[nan, 1.0, 9.0], [0.0, nan, 9.0], [-inf, -inf, -inf], [-inf, nan, -inf]]),
        mx.array([[inf, 1.0, inf], [-1.0, -inf, -0.5], [nan, nan, 2.0]]),
        mx.random.normal((3, 100)).astype(mx.bfloat16),
        mx.random.normal((40, 3)).T,
        long_rows,  # a NaN and a tie past the first 16-value steps
    ]
    before = k.num_threads()
    try:
        k.set_num_threads(2)
        for level in paths(k):
            k.set_max_isa(level)
            for x in cases:
                normalised, index = k.log_softmax_argmax(x)
                assert index.dtype == mx.uint32 and index.shape == x.shape[:-1]
                assert index.tolist() == mx.argmax(x, axis=-1).tolist() == rule(x), (level, x)
                plain = np.asarray(k.log_softmax(x))
                assert np.array_equal(np.asarray(normalised), plain, equal_nan=True), level
    finally:
        k.set_max_isa("best")
        k.set_num_threads(before)


def test_log_softmax_argmax_refuses_what_is_not_logits(k):
    """Not a float array with a last axis: one line naming the op and what it found."""
    with pytest.raises(ValueError, match=r"\[mlxinfer log_softmax_argmax\] x: expected a float"):
        k.log_softmax_argmax(mx.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"found shape \(\)"):
        k.log_softmax_argmax(mx.array(1.0))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_dequantize_matches_mlx(k, bits):
    """``K.dequantize`` (the CPU backend's prefill: a quantized layer's weight as floats for
    the BLAS product) against ``mx.dequantize`` at every width and group size, on every
    instruction-set path: float32 scales (the CPU backend's), float16 and bfloat16 scales (the
    output in their dtype, rounded once from f32), a column block of a weight (a strided view: the sliced
    MLP's) and an odd number of rows (the pool's blocks of 8). Within 1 ulp-ish (4e-7 of the
    largest value): MLX rounds s * q + b without a fused multiply-add."""
    mx.random.seed(bits)
    try:
        for level in paths(k):
            k.set_max_isa(level)
            for group_size in (32, 64, 128):
                w = mx.random.normal((203, 384))
                wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
                for dtype in (mx.float32, mx.float16, mx.bfloat16):
                    sd, bd = s.astype(dtype), b.astype(dtype)
                    got = k.dequantize(wq, sd, bd, group_size, bits)
                    assert got.dtype == dtype and got.shape == (203, 384)
                    # s * q + b of the half scales in f32, rounded once to their dtype (MLX's
                    # own rounds the product and the sum: up to two roundings off this)
                    f = mx.float32
                    want = mx.dequantize(
                        wq, sd.astype(f), bd.astype(f), group_size=group_size, bits=bits
                    )
                    assert rel_err(got, want) <= (4e-7 if dtype == f else 2.0**-8), (level, dtype)
                words = 128 * bits // 32  # the second block of 128 columns
                view = k.dequantize(
                    wq[:, words : 2 * words],
                    s[:, 128 // group_size : 256 // group_size],
                    b[:, 128 // group_size : 256 // group_size],
                    group_size,
                    bits,
                )
                full = mx.dequantize(wq, s, b, group_size=group_size, bits=bits)
                assert rel_err(view, full[:, 128:256]) <= 4e-7, (level, group_size)
    finally:
        k.set_max_isa("best")


def test_dequantize_bad_arguments_are_value_errors(k):
    wq, s, b = mx.quantize(mx.zeros((8, 64)), group_size=32, bits=4)
    with pytest.raises(ValueError, match="bits: expected 2, 3, 4, 5, 6 or 8, found 7"):
        k.dequantize(wq, s, b, 32, 7)
    with pytest.raises(ValueError, match="group_size: expected 32, 64 or 128, found 16"):
        k.dequantize(wq, s, b, 16, 4)
    with pytest.raises(ValueError, match=r"scales/biases: expected float arrays of shape \(8, 2\)"):
        k.dequantize(wq, s[:, :1], b, 32, 4)
    with pytest.raises(ValueError, match="w: expected a 2-D uint32 array"):
        k.dequantize(wq.astype(mx.int32), s, b, 32, 4)


def test_the_isa_setting_caps_the_kernels_and_a_bad_value_is_one_line(k, fresh):
    """MLXINFER_KERNELS_ISA: a level below the CPU's runs that level's paths (kernels.describe
    names it); another architecture's or an unknown name is a ConfigError (the CLI's one-line
    error, exit 1) naming the setting and the accepted names, the kernels' level left as it was."""
    from mlxinfer.errors import ConfigError

    fresh.setenv(kernels.ENV_ISA, "scalar")
    try:
        assert kernels.load().isa() == k.isa() == "scalar"  # one library's setting
        assert kernels.describe().startswith("kernels: scalar on")
    finally:
        k.set_max_isa("best")
    fresh.setattr(kernels, "_loaded", None)
    fresh.setenv(kernels.ENV_ISA, "sse")
    with pytest.raises(ConfigError, match=r"^MLXINFER_KERNELS_ISA='sse': expected 'scalar'"):
        kernels.load()
    assert k.isa() == k.best_isa


def test_the_avx2_cap_keeps_avx_vnni_off_and_avxvnni_names_it(k, fresh):
    """``avx2`` is a client core before AVX-VNNI: its paths without vpdpwssd; ``avxvnni`` (on a
    CPU that has it) the same level with it, which describe names and the plans' key tells
    apart (a plan timed without it is not another's)."""
    from mlxinfer.backends.cpu import compiled

    if k.best_isa == "neon":
        pytest.skip("x86's levels (this CPU is arm64)")
    try:
        k.set_max_isa("avx2")
        assert not k.avx_vnni_available()
        assert kernels.describe().startswith("kernels: avx2 on")
        plain = compiled.key()
        k.set_max_isa("avxvnni")
        if not k.avx_vnni_available():
            pytest.skip("this CPU has no AVX-VNNI (avxvnni in /proc/cpuinfo)")
        assert k.isa() == "avx2" and kernels.describe().startswith("kernels: avx2+avxvnni on")
        assert compiled.key() != plain
    finally:
        k.set_max_isa("best")


def test_the_avx512bw_cap_is_skylake_sp(k, fresh):
    """``avx512bw``: AVX-512 F and BW without VNNI's or VBMI's paths, the tiles' 512-bit path on
    (``vpmaddwd`` + ``vpaddd``); describe names it and the plans' key tells it from the others."""
    from mlxinfer.backends.cpu import compiled

    if k.best_isa != "avx512" or not k.vnni_available():
        pytest.skip("needs AVX-512 VNNI and VBMI (this CPU's best paths) to cap them")
    try:
        full = compiled.key()
        k.set_max_isa("avx512vnni")
        cascade = compiled.key()
        k.set_max_isa("avx512bw")
        assert k.isa() == "avx512" and not k.vnni_available() and k.tiles_wide_available()
        assert not k.tiles_wide_vnni()
        assert kernels.describe().startswith("kernels: avx512bw on")
        assert compiled.key() not in (full, cascade)
    finally:
        k.set_max_isa("best")


def test_the_avx512vnni_cap_is_cascade_lake(k, fresh):
    """``avx512vnni``: AVX-512 with VNNI but without VBMI's paths (the int16 kernel's), the
    tiles' 512-bit path on; describe names it and the plans' key tells it from ``avx512``."""
    from mlxinfer.backends.cpu import compiled

    if k.best_isa != "avx512" or not k.vnni_available():
        pytest.skip("needs AVX-512 VNNI and VBMI (this CPU's best paths) to cap them")
    try:
        full = compiled.key()
        k.set_max_isa("avx512vnni")
        assert k.isa() == "avx512" and not k.vnni_available() and k.tiles_wide_available()
        assert kernels.describe().startswith("kernels: avx512vnni on")
        assert compiled.key() != full
    finally:
        k.set_max_isa("best")
