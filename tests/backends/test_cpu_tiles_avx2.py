"""Tiled layers on a CPU with AVX2 but not AVX-512 VNNI (csrc/src/tiles.cpp's 256-bit path, issue
47 item 6: Intel's client cores, AMD's before Zen 4), the kernels held at AVX2 with
``K.set_max_isa("avx2")``: each product within the int16 rounding bound of the float64
definition, bit for bit the AVX-512 path's where this CPU has it (the same int32 sums, the same
scaling in the same order), non-finite rows NaN; and a tiny quantized model decoding under the
``int16_decode`` plan there gives MLX's own quantized path's logits and tokens, alone and in the
batching engine."""

import mlx.core as mx
import numpy as np
import pytest
from hf_models import add_tokenizer, make_tiny
from int16_definition import assert_within_bound, outlier_rows, random_tiled

from mlxinfer import backends
from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import blocks, compiled, kinds, quantized, tiles
from mlxinfer.backends.cpu import plans as cpu_plans
from mlxinfer.generation import generate_step
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model


def _avx2() -> bool:
    K = kernels.load()
    if K is None or not hasattr(K, "tiles_available"):
        return False
    K.set_max_isa("avx2")
    try:
        return K.tiles_available() and not K.vnni_available()
    finally:
        K.set_max_isa("best")


K = kernels.load()
pytestmark = [
    pytest.mark.skipif(K is None, reason=f"compiled kernels absent: {kernels.reason()}"),
    pytest.mark.skipif(
        mx.default_device().type != mx.DeviceType.cpu, reason="the CPU backend's kernels"
    ),
    pytest.mark.skipif(K is not None and not _avx2(), reason="needs an x86 CPU with AVX2"),
]


def _avx_vnni() -> bool:
    """Whether this CPU runs the AVX2 tiles with AVX-VNNI's vpdpwssd (``set_max_isa("avxvnni")``)."""
    K.set_max_isa("avxvnni")
    try:
        return K.avx_vnni_available()
    finally:
        K.set_max_isa("avx2")


@pytest.fixture
def at_avx2():
    """The kernels held at AVX2 (without AVX-VNNI) for the test; yields whether this CPU also
    runs AVX-512 VNNI (then the tests compare with that path)."""
    K.set_max_isa("best")
    wide = K.vnni_available()
    K.set_max_isa("avx2")
    yield wide
    K.set_max_isa("best")
    compiled.set_int16_decode(False)  # process-wide: never left on for later tests
    blocks.EPOCH += 1


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("half", [False, True])
def test_avx2_tiles_are_the_avx512_tiles_products(bits, group_size, half, at_avx2):
    """1, 2, 5 and 9 rows (two a pass, 5- and 6-bit codes widened once a tile from 4): within the bound of the int16
    rounding, and equal to the AVX-512 path's outputs where this CPU runs it, and to AVX-VNNI's
    (vpdpwssd for vpmaddwd + vpaddd) where it has that."""
    rng = np.random.default_rng(bits * 100 + group_size + half)
    q, s, b, t = random_tiled(rng, bits, group_size, half)
    assert not K.avx_vnni_available()  # the "avx2" cap: a client core before AVX-VNNI
    avx_vnni, cascade_lake, skylake = _avx_vnni(), _cascade_lake(), _skylake()
    for M in (1, 2, 5, 9) + ((257,) if bits == 8 else ()):  # 8-bit codes widened once from 256
        x = outlier_rows(rng, M)
        y = np.array(K.quantized_matvec(mx.array(x), *t, group_size, bits))
        assert_within_bound(y, x, q, s, b, group_size, bits)
        if avx_vnni:
            K.set_max_isa("avxvnni")
            assert (y == np.array(K.quantized_matvec(mx.array(x), *t, group_size, bits))).all()
            K.set_max_isa("avx2")
        if cascade_lake:  # the 512-bit tiles without VBMI: AVX-512's outputs
            K.set_max_isa("avx512vnni")
            assert (y == np.array(K.quantized_matvec(mx.array(x), *t, group_size, bits))).all()
            K.set_max_isa("avx2")
        if skylake:  # and without VNNI (vpmaddwd + vpaddd): the same outputs
            K.set_max_isa("avx512bw")
            assert (y == np.array(K.quantized_matvec(mx.array(x), *t, group_size, bits))).all()
            K.set_max_isa("avx2")
        if at_avx2:  # this CPU has AVX-512 VNNI too: the same outputs, bit for bit
            K.set_max_isa("best")
            assert (y == np.array(K.quantized_matvec(mx.array(x), *t, group_size, bits))).all()
            K.set_max_isa("avx2")


def test_a_non_finite_row_is_nan_and_leaves_the_others(at_avx2):
    """An infinite x makes its row's outputs NaN (its block's scale NaN, not wrapped integers);
    the other rows are untouched and equal for equal inputs."""
    q, s, b = mx.quantize(mx.array(np.linspace(-1, 1, 64 * 128, dtype=np.float32).reshape(64, 128)))
    t = tiles.layout(q, s, b, 4, 64)
    x = np.ones((3, 128), np.float32)
    x[1, 9] = np.inf
    y = np.array(K.quantized_matvec(mx.array(x), *t, 64, 4))
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()
    assert (y[0] == y[2]).all()


def _skylake() -> bool:
    """Whether this CPU runs the tiles' 512-bit path without VNNI (``set_max_isa("avx512bw")``:
    AVX-512 F and BW, Skylake-SP's)."""
    K.set_max_isa("avx512bw")
    try:
        return K.tiles_wide_available() and not K.tiles_wide_vnni() and not K.vnni_available()
    finally:
        K.set_max_isa("avx2")


def _cascade_lake() -> bool:
    """Whether this CPU runs the tiles' 512-bit path without VBMI (``set_max_isa("avx512vnni")``)."""
    K.set_max_isa("avx512vnni")
    try:
        return K.tiles_wide_available() and not K.vnni_available()
    finally:
        K.set_max_isa("avx2")


@pytest.mark.parametrize("level", ["avx2", "avx512bw", "avx512vnni"])
def test_the_int16_decode_plan_without_vbmi_gives_mlxs_logits_and_tokens(
    tmp_path, monkeypatch, at_avx2, level
):
    """A tiny 4-bit Llama with a tied 8-bit head, on AVX2 and on AVX-512 VNNI without VBMI
    (Cascade Lake: the tiles' 512-bit path): the plan is offered (its tiles; the few-row int16
    path needs VBMI), a 40-token prompt's products on the tiles (none through the dequantized
    weight) and each position's logits, then each decode step's, within 1e-3 of the largest of
    MLX's quantized path's, the greedy tokens the same, alone and as the engine's 3 rows."""
    if level == "avx512vnni" and not _cascade_lake():
        pytest.skip("this CPU has no AVX-512 VNNI (avx512_vnni in /proc/cpuinfo)")
    if level == "avx512bw" and not _skylake():
        pytest.skip("this CPU has no AVX-512 BW (avx512bw in /proc/cpuinfo)")
    K.set_max_isa(level)
    path, _ = make_tiny(
        tmp_path / "hf", perturb_vectors=True, model_type="llama", tie_word_embeddings=True
    )
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=4, group_size=32, dtype="float32")
    monkeypatch.setenv(backends.ENV, "0")
    plain, _ = load_model(tmp_path / "q")
    monkeypatch.delenv(backends.ENV)
    model, _ = load_model(tmp_path / "q")
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    assert compiled.int16_decode_fits(model)
    kinds.set_plan(model, "int16_decode", "int16")
    dequantized = []  # a prompt's products through the dequantized weight and BLAS
    many_rows = quantized.CPUQuantizedLinear._many_rows
    monkeypatch.setattr(
        quantized.CPUQuantizedLinear,
        "_many_rows",
        lambda layer, x: dequantized.append(x.shape) or many_rows(layer, x),
    )
    p = [(7 + 13 * i) % 256 for i in range(41)]  # 40 prompt rows: the tiles' (AVX2_ROWS)
    cache, plain_cache = model.make_cache(), plain.make_cache()
    got = np.array(model(mx.array([p[:-1]]), cache=cache)[0])
    want = np.array(plain(mx.array([p[:-1]]), cache=plain_cache)[0])
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
    assert dequantized == []
    for token in p[-1:] + [3, 90, 17]:
        got = np.array(model(mx.array([[token]]), cache=cache)[0, -1])
        want = np.array(plain(mx.array([[token]]), cache=plain_cache)[0, -1])
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
    assert [t for t, _ in generate_step(p, model, max_tokens=8)] == [
        t for t, _ in generate_step(p, plain, max_tokens=8)
    ]
    from mlxinfer.batch import Engine

    prompts = [[(3 + 17 * i + 5 * n) % 256 for i in range(n)] for n in (9, 23, 14)]
    alone = [[t for t, _ in generate_step(q, plain, max_tokens=6)] for q in prompts]
    with Engine(model, max_batch=4, prefill_step=64) as engine:
        handles = [engine.submit(q, max_tokens=6) for q in prompts]
        assert [[s.token for s in h.steps()] for h in handles] == alone
    assert any("_cpu_tiles" in m.__dict__ and "scales" in m for m in model.modules())


def test_the_tiles_take_the_rows_they_win_at_on_avx2(at_avx2):
    """On AVX2 the tiles pay up to ``tiles.AVX2_ROWS[bits]`` rows, ``AVX_VNNI_ROWS`` with AVX-VNNI
    (docs/performance.md: against the float kernel below 32 rows, the dequantized weight and
    BLAS from there): beyond, the tiles are not used (None: the caller's path); where AVX-512
    VNNI runs, every row count takes them, and a prompt's rows are the int16_rows plan's (with
    VBMI) or the tiles' (without: Cascade Lake)."""

    class Owner:
        pass

    compiled.set_int16_decode(True)
    levels = [("avx2", tiles.AVX2_ROWS)] + (
        [("avxvnni", tiles.AVX_VNNI_ROWS)] if _avx_vnni() else []
    )
    for level, table in levels:
        K.set_max_isa(level)
        for bits in (4, 5, 6, 8):
            q, s, b = mx.quantize(mx.ones((64, 128)), group_size=32, bits=bits)
            rows = table[bits]
            assert tiles.product(mx.ones((rows, 128)), Owner(), q, s, b, 32, bits) is not None
            assert tiles.product(mx.ones((rows + 1, 128)), Owner(), q, s, b, 32, bits) is None
            assert tiles.takes_prompt(rows, bits) and not tiles.takes_prompt(rows + 1, bits)
    K.set_max_isa("avx2")
    for level, there in (("avx512vnni", _cascade_lake()), ("avx512bw", _skylake())):
        if there:  # AVX-512 without VBMI (or VNNI): the 512-bit tiles take every prompt
            K.set_max_isa(level)
            assert tiles.wide() and tiles.takes_prompt(600, 5)
            K.set_max_isa("avx2")
    if at_avx2:  # AVX-512 VNNI here: every row count takes the tiles
        K.set_max_isa("best")
        q, s, b = mx.quantize(mx.ones((64, 128)), group_size=32, bits=6)
        assert tiles.product(mx.ones((600, 128)), Owner(), q, s, b, 32, 6) is not None
        assert not tiles.takes_prompt(64, 4)  # there the int16_rows plan decides
        K.set_max_isa("avx2")
