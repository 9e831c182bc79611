"""The int16 product for a prefill's rows (csrc/src/prefill_i16.cpp, ``compiled.int16_product``;
issue 47, item 3): x rounded to int16 per block of 32 inputs and AVX-512 VNNI's products. Each
output against a float64 definition within the bound that rounding allows (derived below), for
every width, group size and tail of rows and inputs; a tiny quantized model's prompt through it
gives MLX's own quantized path's logits within that bound's order and the same greedy tokens,
with every many-row product taken by the kernel; bad arguments are one-line errors."""

import mlx.core as mx
import numpy as np
import pytest
from hf_models import add_tokenizer, make_tiny
from int16_definition import assert_within_bound, definition, outlier_rows, random_tiled
from kernel_calls import CountedKernels

from mlxinfer import backends
from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import compiled, kinds, quantized, tiles, timing
from mlxinfer.backends.cpu import plans as cpu_plans
from mlxinfer.generation import generate_step
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model

K = kernels.load()
pytestmark = [
    pytest.mark.skipif(K is None, reason=f"compiled kernels absent: {kernels.reason()}"),
    pytest.mark.skipif(
        mx.default_device().type != mx.DeviceType.cpu, reason="the CPU backend's kernels"
    ),
    pytest.mark.skipif(
        K is not None and not (hasattr(K, "vnni_available") and K.vnni_available()),
        reason="the int16 product needs AVX-512 F, BW, VNNI and VBMI (this CPU lacks one)",
    ),
]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int16_product_is_within_its_rounding_bound(bits, group_size):
    rng = np.random.default_rng(bits * 1000 + group_size)
    # rows: the 4-row passes and each tail; inputs: a multiple of 64 and one with a 32 tail
    for M, N, Kd in [(1, 32, 128), (3, 64, 384), (4, 32, 640), (9, 96, 384), (17, 64, 128)]:
        if Kd % group_size:
            continue
        w = mx.array(rng.normal(size=(N, Kd)).astype(np.float32) * 0.05)
        q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
        x = rng.normal(size=(M, Kd)).astype(np.float32)
        x[0, 3] = 40.0  # an outlier: its block's scale is 40 / 32767
        if M > 2:
            x[2] = 0.0  # a zero row: scale 0, outputs exactly 0
        y = np.array(K.quantized_matmul_i16(mx.array(x), q, s, b, group_size, bits), np.float64)
        exact, bound = definition(x, q, s, b, group_size, bits)
        assert y.shape == (M, N)
        assert (np.abs(y - exact) <= bound).all(), (M, N, Kd, np.abs(y - exact).max())
        if M > 2:
            assert (y[2] == 0).all()


def test_batched_and_typed_inputs_and_a_non_finite_row():
    rng = np.random.default_rng(7)
    w = mx.array(rng.normal(size=(64, 256)).astype(np.float32))
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    x = rng.normal(size=(2, 5, 256)).astype(np.float32)
    y = K.quantized_matmul_i16(mx.array(x), q, s, b, 64, 4)
    assert y.shape == (2, 5, 64) and y.dtype == mx.float32
    exact, bound = definition(x.reshape(10, 256), q, s, b, 64, 4)
    assert (np.abs(np.array(y).reshape(10, 64) - exact) <= bound).all()
    # bfloat16 x and scales: the output in bfloat16, from the same float32 product
    yb = K.quantized_matmul_i16(
        mx.array(x).astype(mx.bfloat16), q, s.astype(mx.bfloat16), b.astype(mx.bfloat16), 64, 4
    )
    assert yb.dtype == mx.bfloat16
    x[1, 2, 7] = np.inf  # a non-finite input makes its row NaN, never a wrapped integer
    yn = np.array(K.quantized_matmul_i16(mx.array(x), q, s, b, 64, 4))
    assert np.isnan(yn[1, 2]).all() and np.isfinite(np.delete(yn.reshape(10, 64), 7, 0)).all()


def test_bad_arguments_are_one_line_errors():
    w = mx.zeros((48, 64))
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    x = mx.zeros((20, 64))
    with pytest.raises(ValueError, match=r"w: .*multiple of 32 rows, found shape \(48, 8\)"):
        K.quantized_matmul_i16(x, q, s, b, 32, 4)
    q, s, b = mx.quantize(mx.zeros((32, 64)), group_size=32, bits=4)
    with pytest.raises(ValueError, match="group_size: expected 32, 64 or 128, found 16"):
        K.quantized_matmul_i16(x, q, s, b, 16, 4)
    with pytest.raises(ValueError, match=r"x: expected a float array of shape \(\.\.\., 64\)"):
        K.quantized_matmul_i16(mx.zeros((20, 32)), q, s, b, 32, 4)


IDS = [(5 + 37 * i) % 256 for i in range(40)]


@pytest.mark.parametrize("tied", [False, True])
def test_a_prompt_through_the_int16_products_gives_mlx_logits_and_tokens(
    tied, tmp_path, monkeypatch
):
    """A tiny quantized Llama (q/k/v and gate/up stacked; an untied head, or the embedding tied
    as the head) and its 40-token prompt: with ``int16_rows`` at 16 every product of the prompt's
    rows is the int16 kernel's (the stacked siblings' as one; the head's over the 40 positions
    too: ``perplexity`` reads them all), the logits
    within 1e-3 of the largest of MLX's own quantized path's (the kernel's bound is about 1e-5 of
    it here), the greedy tokens the same; the default plan (``off``) never takes it."""
    path, _ = make_tiny(
        tmp_path / "hf", perturb_vectors=True, model_type="llama", tie_word_embeddings=tied
    )
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=5, group_size=32, dtype="float32")
    monkeypatch.setenv(backends.ENV, "0")  # MLX's own layers and quantized_matmul
    plain, _ = load_model(tmp_path / "q")
    monkeypatch.delenv(backends.ENV)
    reference = np.array(plain(mx.array([IDS]))[0])
    tokens = [t for t, _ in generate_step(IDS, plain, max_tokens=8)]
    counter = CountedKernels(K, ("quantized_matmul_i16",))
    monkeypatch.setattr(kernels, "load", lambda: counter)
    model, _ = load_model(tmp_path / "q")
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    layers = kinds.int16_linears(model)
    assert len(layers) == 7 * len(model.layers) + 1  # and the LM head, tied or not
    assert all(m.cpu_int16_rows == quantized.INT16_NEVER for m in layers)  # the default
    kinds.set_plan(model, "int16_rows", 16)
    with quantized.stepwise_prefill(model):
        logits = np.array(model(mx.array([IDS]))[0])
    # a product each: q | k | v and gate | up stacked, o_proj, down_proj, the head
    assert counter.calls["quantized_matmul_i16"] == 4 * len(model.layers) + 1
    assert np.abs(logits - reference).max() <= 1e-3 * np.abs(reference).max()
    assert [t for t, _ in generate_step(IDS, model, max_tokens=8)] == tokens


def test_a_batch_gives_each_prompt_its_tokens_alone(tmp_path, monkeypatch):
    """The int16 products round each row of x by itself: prompts of 17-45 tokens prefilled
    together by the batching engine (their rows in one product, their attention under one mask)
    give each prompt the greedy tokens it gets alone, int16 products and all."""
    from mlxinfer.batch import Engine

    path, _ = make_tiny(tmp_path / "hf", perturb_vectors=True, model_type="llama")
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=4, group_size=32, dtype="float32")
    counter = CountedKernels(K, ("quantized_matmul_i16",))
    monkeypatch.setattr(kernels, "load", lambda: counter)
    model, _ = load_model(tmp_path / "q")
    cpu_plans.set_plans(model, {**cpu_plans.forced_plans("kernels"), "int16_rows": 16})
    prompts = [[(3 + 17 * i + 5 * n) % 256 for i in range(n)] for n in (17, 45, 30)]
    alone = [[t for t, _ in generate_step(p, model, max_tokens=6)] for p in prompts]
    calls, counter.calls["quantized_matmul_i16"] = counter.calls["quantized_matmul_i16"], 0
    assert calls > 0  # the prompts' products alone were int16 ones
    with Engine(model, max_batch=4, prefill_step=64) as engine:
        handles = [engine.submit(p, max_tokens=6) for p in prompts]
        together = [[s.token for s in h.steps()] for h in handles]
    assert counter.calls["quantized_matmul_i16"] > 0
    assert together == alone


@pytest.mark.parametrize("bits", [8, 4])
def test_a_tied_heads_decode_rows_take_the_int16_kernel_under_its_plan(bits, tmp_path, monkeypatch):
    """The ``int16_head`` plan (up to how many rows a quantized tied head's products take the
    int16 kernel's few-row path): off by default; at 16, every decode step's head product, alone
    and in the batching engine's steps, is one int16 call, the logits within 1e-3 of the largest of
    MLX's own quantized path's, and the greedy tokens the same, alone and batched."""
    from mlxinfer.batch import Engine

    path, _ = make_tiny(
        tmp_path / "hf", perturb_vectors=True, model_type="llama", tie_word_embeddings=True
    )
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=bits, group_size=32, dtype="float32")
    monkeypatch.setenv(backends.ENV, "0")  # MLX's own layers and quantized_matmul
    plain, _ = load_model(tmp_path / "q")
    monkeypatch.delenv(backends.ENV)
    prompts = [[(3 + 17 * i + 5 * n) % 256 for i in range(n)] for n in (9, 23, 14)]
    reference = [np.array(plain(mx.array([p]))[0, -1]) for p in prompts]
    tokens = [[t for t, _ in generate_step(p, plain, max_tokens=6)] for p in prompts]
    counter = CountedKernels(K, ("quantized_matmul_i16",))
    monkeypatch.setattr(kernels, "load", lambda: counter)
    model, _ = load_model(tmp_path / "q")
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    assert kinds.int16_heads(model) == [model.head]
    assert model.head.cpu_int16_head_rows == 0  # the default: never
    generate_step(prompts[0], model, max_tokens=2)
    assert counter.calls["quantized_matmul_i16"] == 0
    kinds.set_plan(model, "int16_head", 16)
    for p, ref in zip(prompts, reference):
        logits = np.array(model(mx.array([p]))[0, -1])  # int16_rows off: the head's row alone
        assert np.abs(logits - ref).max() <= 1e-3 * np.abs(ref).max()
    counter.calls["quantized_matmul_i16"] = 0
    alone = [[t for t, _ in generate_step(p, model, max_tokens=6)] for p in prompts]
    assert alone == tokens
    assert counter.calls["quantized_matmul_i16"] >= 3 * 5  # each decode step's head
    with Engine(model, max_batch=4, prefill_step=64) as engine:
        handles = [engine.submit(p, max_tokens=6) for p in prompts]
        together = [[s.token for s in h.steps()] for h in handles]
    assert together == tokens


def test_the_int16_head_plan_is_the_most_rows_it_wins_at(tmp_path, monkeypatch):
    """``measure_int16_head`` times the head at 1, 2, 4, 8 and 16 rows and stops at the first
    count where the int16 kernel does not win: the plan is the last count it won at (0: none)."""
    from mlxinfer.backends.cpu import choices

    path, _ = make_tiny(tmp_path / "hf", model_type="llama", tie_word_embeddings=True)
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=8, group_size=32, dtype="float32")
    model, _ = load_model(tmp_path / "q")
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    for wins_up_to, expected in ((4, 4), (0, 0), (16, 16)):
        timed = []

        def pick(options, time_option, rounds, wins_up_to=wins_up_to, timed=timed):
            rows = len(timed) + 1
            timed.append(rows)
            won = choices.INT16_HEAD_TRIED[rows - 1] <= wins_up_to
            return ("int16" if won else "float"), {o: time_option(o) for o in options}

        monkeypatch.setattr(choices, "pick", pick)
        most, seconds = choices.measure_int16_head(model)
        assert most == expected
        assert sorted(seconds) == list(choices.INT16_HEAD_TRIED[: len(timed)])


@pytest.fixture
def int16_decode_off():
    yield
    compiled.set_int16_decode(False)  # process-wide: never left on for later tests


# Tiled layers (csrc/src/tiles.cpp, backends/cpu/tiles.py): the codes laid out at load.


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_a_tiled_layout_holds_each_code_where_tiles_cpp_reads_it(bits):
    """Each code found at the byte and bit the layout's comment names (n = 32 t + 16 v + j,
    k = 32 b + 2 p + e; pairs [t][b][p] of 8 * bits bytes; 4- to 6-bit: the low 4 bits in byte
    2 j + e, v the nibble, bit 4 + i in bit 2 j + e of the 32-bit mask at 32 + 8 i + 4 v; 8-bit:
    byte 32 v + 2 j + e), the codes read by MLX's own dequantize (scale 1, bias 0), and the
    scales in [tile][group][32] order, float16 kept where every value is one."""
    rng = np.random.default_rng(bits)
    N, Kd, gs = 64, 128, 32
    q, s, b = mx.quantize(mx.array(rng.normal(size=(N, Kd)).astype(np.float32)), gs, bits)
    codes = np.array(
        mx.dequantize(q, mx.ones_like(s), mx.zeros_like(b), group_size=gs, bits=bits)
    ).astype(np.int64)
    t_codes, t_scales, t_biases = tiles.layout(q, s, b, bits, gs)
    raw = np.array(t_codes).reshape(-1)
    pair = 64 * bits // 8  # bytes a pair of inputs for a tile's 32 outputs: 64 codes
    n, k = np.meshgrid(np.arange(N), np.arange(Kd), indexing="ij")
    t, v, j, blk, p, e = n // 32, n % 32 // 16, n % 16, k // 32, k % 32 // 2, k % 2
    at = ((t * (Kd // 32) + blk) * 16 + p) * pair
    if bits == 8:
        got = raw[at + 32 * v + 2 * j + e]
    else:
        got = (raw[at + 2 * j + e] >> (4 * v)) & 15
        for i in range(bits - 4):
            mask = at + 32 + 8 * i + 4 * v  # a little-endian uint32: bit l in byte l // 8
            lane = 2 * j + e
            got = got + (((raw[mask + lane // 8] >> (lane % 8)) & 1) << (4 + i))
    assert t_codes.dtype == mx.uint8 and t_codes.shape == (N, Kd * bits // 8)
    assert (got == codes).all()
    G = Kd // gs
    want = np.array(s).reshape(N // 32, 32, G).transpose(0, 2, 1).reshape(N, G)
    assert t_scales.dtype == mx.float32 and (np.array(t_scales) == want).all()  # not halves
    half = tiles.layout(q, s.astype(mx.float16).astype(mx.float32), b.astype(mx.float16), bits, gs)
    assert half[1].dtype == half[2].dtype == mx.float16


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("half", [False, True])
def test_tiled_products_are_the_int16_tiles_products(bits, group_size, half):
    """A tiled layer's product of 1-17 rows (a pass is 8 rows) is within the int16 rounding
    bound of the float64 definition, and bit for bit ``quantized_matmul_i16``'s (the same
    arithmetic on tiles it lays out per product) where that takes its tiles (over 4 rows)."""
    rng = np.random.default_rng(bits * 100 + group_size)
    q, s, b, t = random_tiled(rng, bits, group_size, half)
    assert t[1].dtype == (mx.float16 if half else mx.float32)
    for M in (1, 2, 5, 8, 9, 17):
        x = outlier_rows(rng, M)
        y = np.array(K.quantized_matvec(mx.array(x), *t, group_size, bits))
        assert_within_bound(y, x, q, s, b, group_size, bits)
        if M > 4:
            assert (
                y == np.array(K.quantized_matmul_i16(mx.array(x), q, s, b, group_size, bits))
            ).all()


@pytest.mark.parametrize(("bits", "N", "Kin"), [(4, 32 * 37, 1536), (8, 32 * 131, 1024)])
def test_a_tiled_products_tasks_on_the_threads_leave_no_output_out(bits, N, Kin):
    """Products large enough to share out (909 KB and 4.3 MB of codes, a prime number of tiles):
    a decode step's rows (1, 8: tasks of about 1 MB, at least one a thread) and a prompt's (9:
    four a thread) are within the rounding bound of the float64 definition, every output, and
    the same bits on one thread as on two (each output is one thread's whole sum)."""
    rng = np.random.default_rng(bits + N)
    q, s, b, t = random_tiled(rng, bits, 32, True, N=N, K=Kin)
    before = K.num_threads()
    try:
        for M in (1, 8, 9):
            x = outlier_rows(rng, M, K=Kin)
            K.set_num_threads(2)
            y2 = np.array(K.quantized_matvec(mx.array(x), *t, 32, bits))
            K.set_num_threads(1)
            y1 = np.array(K.quantized_matvec(mx.array(x), *t, 32, bits))
            assert_within_bound(y2, x, q, s, b, 32, bits)
            assert (y1 == y2).all(), M
    finally:
        K.set_num_threads(before)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("half", [False, True])
def test_a_symmetric_layers_tiles_drop_its_biases_and_give_the_same_outputs(bits, half):
    """Where every bias is -2^(bits - 1) times its scale (GGUF's Q4_0, Q5_0 and Q8_0 imported
    exactly), the tiles hold no biases (shape (0,)) and the products take them from the scales:
    the outputs bit for bit those of the same tiles with the biases kept, on every path this CPU
    has (AVX-512, AVX2; int16 and int8 activations), and within the float64 definition's bound.
    One bias off by one float16 step keeps them all, as does a zero scale's bias of the other
    sign (compared bit for bit)."""
    rng = np.random.default_rng(bits + 10 * half)
    N, Kd, gs = 96, 384, 32
    q, s, _ = mx.quantize(mx.array(rng.normal(size=(N, Kd)).astype(np.float32) * 0.05), gs, bits)
    s = s.astype(mx.float16) if half else s
    b = s * -(2 ** (bits - 1))
    dropped = tiles.layout(q, s, b, bits, gs)
    kept = K.tile_layer(q, s, b, gs, bits, half, False)
    assert dropped[2].shape == (0,) and kept[2].shape == s.shape
    assert (np.array(dropped[1]) == np.array(kept[1])).all()
    off = np.array(b)
    off[3, 1] = np.nextafter(off[3, 1], np.float16(0) if half else np.float32(0))
    assert tiles.layout(q, s, mx.array(off), bits, gs)[2].shape == s.shape
    zero_s, zero_b = np.array(s), np.array(b)  # a zero scale: its bias -0.0, not +0.0
    zero_s[2, 0], zero_b[2, 0] = 0.0, 0.0
    assert tiles.layout(q, mx.array(zero_s), mx.array(zero_b), bits, gs)[2].shape == s.shape
    zero_b[2, 0] = -0.0
    assert tiles.layout(q, mx.array(zero_s), mx.array(zero_b), bits, gs)[2].shape == (0,)
    paths = [("best", False), ("best", True), ("avx2", False), ("avx2", True)]
    try:
        for isa, int8 in paths:
            K.set_max_isa(isa)
            K.set_int8_activations(int8)
            if not K.tiles_available():
                continue
            for M in (1, 3, 8, 17):
                x = mx.array(outlier_rows(rng, M))
                y = np.array(K.quantized_matvec(x, *dropped, gs, bits))
                assert (y == np.array(K.quantized_matvec(x, *kept, gs, bits))).all(), (isa, int8, M)
                if not int8:
                    assert_within_bound(y, np.array(x), q, s, b, gs, bits)
    finally:
        K.set_max_isa("best")
        K.set_int8_activations(False)


def test_bad_tiled_arrays_are_one_line_errors():
    q, s, b = mx.quantize(mx.zeros((64, 128)), group_size=32, bits=4)
    codes, ts, tb = tiles.layout(q, s, b, 4, 32)
    x = mx.zeros((1, 128))
    q3, s3, b3 = mx.quantize(mx.zeros((64, 128)), group_size=32, bits=3)
    with pytest.raises(ValueError, match=r"tile_layer\] bits: a tiled layer has 4, 5, 6 or 8"):
        K.tile_layer(q3, s3, b3, 32, 3, False)
    with pytest.raises(ValueError, match=r"tile_layer\] w: expected a multiple of 32 rows"):
        K.tile_layer(q[:48], s[:48], b[:48], 32, 4, False)
    with pytest.raises(ValueError, match="bits: a tiled layer has 4, 5, 6 or 8, found 3"):
        K.quantized_matvec(x, codes, ts, tb, 32, 3)
    with pytest.raises(
        ValueError, match=r"w: expected a tiled uint8 array .* found shape \(48, 64\)"
    ):
        K.quantized_matvec(x, codes[:48], ts[:48], tb[:48], 32, 4)
    with pytest.raises(ValueError, match="scales/biases: a tiled layer's are both float32 or both"):
        K.quantized_matvec(x, codes, ts, tb.astype(mx.float16), 32, 4)
    with pytest.raises(ValueError, match=r"\(biases \(0,\) where dropped\), found .* and \(3,\)"):
        K.quantized_matvec(x, codes, ts, tb.reshape(-1)[:3], 32, 4)
    with pytest.raises(ValueError, match=r"x: expected a float array of shape \(\.\.\., 128\)"):
        K.quantized_matvec(mx.zeros((1, 64)), codes, ts, tb, 32, 4)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_few_row_quantized_products_take_the_int16_path_when_set(bits, int16_decode_off):
    """``K.set_int16_decode_rows(4)``: the quantized kernel's products of up to 4 rows (decode's,
    the blocks' kernels' too) are the int16 product's, within its rounding bound and not the
    float32 kernel's bits; 5 rows, or the setting back at 0, are the float kernel's again."""
    rng = np.random.default_rng(bits)
    w = mx.array(rng.normal(size=(96, 640)).astype(np.float32) * 0.05)
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    for M in (1, 3, 4, 5):
        x = rng.normal(size=(M, 640)).astype(np.float32)
        float_y = np.array(K.quantized_matvec(mx.array(x), q, s, b, 32, bits))
        K.set_int16_decode_rows(4)
        assert K.int16_decode_rows() == 4
        y = np.array(K.quantized_matvec(mx.array(x), q, s, b, 32, bits))
        K.set_int16_decode_rows(0)
        if M == 5:
            assert (y == float_y).all()
            continue
        exact, bound = definition(x, q, s, b, 32, bits)
        assert (np.abs(y - exact) <= bound).all(), (M, np.abs(y - exact).max())
        assert (y != float_y).any()  # the other path's rounding: it ran
        assert (np.array(K.quantized_matvec(mx.array(x), q, s, b, 32, bits)) == float_y).all()


@pytest.mark.parametrize("bits", [4, 5, 3])
def test_the_int16_decode_plan_gives_mlxs_logits_and_tokens(
    bits, tmp_path, monkeypatch, int16_decode_off
):
    """A tiny 4-, 5- or 3-bit Llama decoding under the ``int16_decode`` plan (every product of
    the blocks' kernels and the head with x in int16; 4- and 5-bit layers and the 8-bit head
    tiled, 3-bit through the few-row path): each step's logits within 1e-3 of the largest of MLX's own
    quantized path's, the greedy tokens the same, alone and in the batching engine;
    ``float`` (the default) sets it off and drops the tiles."""
    path, _ = make_tiny(
        tmp_path / "hf", perturb_vectors=True, model_type="llama", tie_word_embeddings=True
    )
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=bits, group_size=32, dtype="float32")
    monkeypatch.setenv(backends.ENV, "0")
    plain, _ = load_model(tmp_path / "q")
    monkeypatch.delenv(backends.ENV)
    model, _ = load_model(tmp_path / "q")
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    assert cpu_plans.current(model)["int16_decode"] == "float" and K.int16_decode_rows() == 0
    kinds.set_plan(model, "int16_decode", "int16")
    assert K.int16_decode_rows() == 4
    for p in ([(7 + 13 * i) % 256 for i in range(11)], IDS[:25]):
        cache, plain_cache = model.make_cache(), plain.make_cache()
        model(mx.array([p[:-1]]), cache=cache)
        plain(mx.array([p[:-1]]), cache=plain_cache)
        for token in p[-1:] + [3, 90, 17]:  # decode steps: one row each
            got = np.array(model(mx.array([[token]]), cache=cache)[0, -1])
            want = np.array(plain(mx.array([[token]]), cache=plain_cache)[0, -1])
            assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
        tokens = [t for t, _ in generate_step(p, plain, max_tokens=8)]
        assert [t for t, _ in generate_step(p, model, max_tokens=8)] == tokens
    # The batching engine's steps of 3 rows (prompts of 9, 23 and 14 tokens) take it too: each
    # row's x is rounded by itself, so each prompt gets MLX's greedy tokens for it alone.
    from mlxinfer.batch import Engine

    prompts = [[(3 + 17 * i + 5 * n) % 256 for i in range(n)] for n in (9, 23, 14)]
    alone = [[t for t, _ in generate_step(p, plain, max_tokens=6)] for p in prompts]
    with Engine(model, max_batch=4, prefill_step=64) as engine:
        handles = [engine.submit(p, max_tokens=6) for p in prompts]
        assert [[s.token for s in h.steps()] for h in handles] == alone
    tiled = [m for m in model.modules() if "_cpu_tiles" in m.__dict__]
    layers = {m.bits for m in tiled if "scales" in m}  # the blocks' (the tied head: int16_head)
    assert layers == ({bits} if bits != 3 and tiles.available() else set())
    # where layers can be tiled, int16 is the static default the timed plans are checked against
    assert timing.static_default(model)["int16_decode"] == ("int16" if tiled else "float")
    kinds.set_plan(model, "int16_decode", "float")
    assert K.int16_decode_rows() == 0
    assert not any("_cpu_tiles" in m.__dict__ for m in tiled)


def test_a_symmetric_models_decode_reads_each_layer_once_as_its_tiles(tmp_path, int16_decode_off):
    """A tiny 4-bit Llama whose every bias is -8 times its float16 scale (as a Q4_0 GGUF imports),
    decoded under ``int16``: every quantized layer and the tied head tiled once (a fused group's
    siblings as the group, not each again), and ``bench``'s bytes a decode step reads are the
    parameters' with each layer's scales and biases (float32 as loaded) counted as its tiles
    hold them: float16 scales (N x G x 2 bytes), no biases; the codes the same bytes."""
    from mlx.utils import tree_flatten

    from mlxinfer.bench.bandwidth import weight_bytes_per_token

    path, _ = make_tiny(
        tmp_path / "hf", perturb_vectors=True, model_type="llama", tie_word_embeddings=True
    )
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=4, group_size=32, dtype="float32")
    weights = mx.load(str(tmp_path / "q" / "model.safetensors"))
    for name in [n for n in weights if n.endswith(".scales")]:
        scale = weights[name].astype(mx.float16)
        weights[name] = scale
        weights[name[: -len("scales")] + "biases"] = scale * -8
    mx.save_safetensors(str(tmp_path / "q" / "model.safetensors"), weights)
    (tmp_path / "q" / "mlxinfer-manifest.json").unlink()  # its sizes were the converter's
    model, _ = load_model(tmp_path / "q")
    cpu_plans.set_plans(model, {**cpu_plans.forced_plans("kernels"), "int16_decode": "int16"})
    list(generate_step(IDS[:9], model, max_tokens=3))
    quantized_layers = [m for m in model.modules() if "scales" in m]
    held = [m.__dict__["_cpu_tiles"][3] for m in model.modules() if "_cpu_tiles" in m.__dict__]
    held += [
        g.__dict__["_cpu_tiles"][3]
        for g in {
            id(m.cpu_fused[0]): m.cpu_fused[0] for m in model.modules() if "cpu_fused" in m.__dict__
        }.values()
        if "_cpu_tiles" in g.__dict__
    ]
    if not tiles.available():
        pytest.skip(
            "tiled layers need AVX2 or AVX-512 (this CPU has neither at the kernels' level)"
        )
    codes = sum(t[0].size for t in held)
    assert codes == sum(m.weight.nbytes for m in quantized_layers)  # each layer's codes once
    assert all(t[2].shape == (0,) and t[1].dtype == mx.float16 for t in held)
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    want = params - sum(
        m.scales.nbytes + m.biases.nbytes - m.scales.size * 2 for m in quantized_layers
    )
    assert weight_bytes_per_token(model) == want


def test_the_plans_timing_makes_each_layers_tiles_once(int16_decode_off):
    """Inside ``tiles.kept()`` (the plans' timing switches ``int16_decode`` on and off each
    round) a layer's tiles stay when the plan is set off, so each layout is made once; at its
    end, with the plan off, they are dropped; with it on, kept."""
    q, s, b = mx.quantize(mx.zeros((64, 128)), group_size=32, bits=4)

    class Owner:
        pass

    owner = Owner()
    with tiles.kept():
        compiled.set_int16_decode(True)
        made = tiles.of(owner, q, s, b, 32, 4)
        compiled.set_int16_decode(False)
        assert tiles.of(owner, q, s, b, 32, 4) is None  # off: not used ...
        compiled.set_int16_decode(True)
        assert tiles.of(owner, q, s, b, 32, 4) is made  # ... but kept, not made again
        compiled.set_int16_decode(False)
    assert "_cpu_tiles" not in owner.__dict__
    with tiles.kept():
        compiled.set_int16_decode(True)
        made = tiles.of(owner, q, s, b, 32, 4)
    assert owner.__dict__["_cpu_tiles"][3] is made
    compiled.set_int16_decode(False)
    assert "_cpu_tiles" not in owner.__dict__


def test_a_tiled_product_has_the_dtype_mlxs_arrays_give(int16_decode_off):
    """Tiles keep float16 scales only where exact: bfloat16 scales are tiled as float32, and
    the product still comes out in bfloat16 (x's and the layer's dtype), as MLX's would."""
    rng = np.random.default_rng(3)
    q, s, b = mx.quantize(mx.array(rng.normal(size=(64, 128)).astype(np.float32)), 32, 4)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    x = mx.array(rng.normal(size=(2, 128)).astype(np.float32)).astype(mx.bfloat16)

    class Owner:
        pass

    assert tiles.product(x, Owner(), q, s, b, 32, 4) is None  # the plan off: the caller's path
    compiled.set_int16_decode(True)
    y = tiles.product(x, Owner(), q, s, b, 32, 4)
    want = K.quantized_matvec(x, q, s, b, 32, 4)
    assert y.dtype == want.dtype == mx.bfloat16
    got, want = np.array(y.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()  # bfloat16's rounding, twice


def test_a_layer_is_not_tiled_where_the_machine_has_no_room(int16_decode_off, monkeypatch):
    """A second copy of a layer must not push the machine into paging: where what it can give
    less the layer's tiles (codes' bytes again, scales and biases at most float32: 64 x 128
    4-bit is 4 KiB + 2 KiB) falls below ``RESERVE``, the product takes the caller's path
    (None), memory is asked once (not every product), and ``skipped_bytes`` counts the layer;
    with room, the tiles are made."""
    from mlxinfer.platform.memory import Capacity

    q, s, b = mx.quantize(mx.zeros((64, 128)), group_size=32, bits=4)
    need = 64 * 128 // 2 + 2 * 64 * 4 * 4
    asked = []

    def capacity(free):
        def read(*_):
            asked.append(free)
            return Capacity(free, "a test's")

        return read

    class Owner:
        pass

    compiled.set_int16_decode(True)
    monkeypatch.setattr(tiles.memory, "available", capacity(tiles.RESERVE + need - 1))
    owner = Owner()
    x = mx.ones((2, 128))
    assert tiles.product(x, owner, q, s, b, 32, 4) is None
    assert tiles.product(x, owner, q, s, b, 32, 4) is None
    assert len(asked) == 1 and tiles.skipped_bytes == need
    monkeypatch.setattr(tiles.memory, "available", capacity(tiles.RESERVE + need))
    assert tiles.of(Owner(), q, s, b, 32, 4) is not None
    compiled.set_int16_decode(False)  # drops the tiles, and the count
    assert tiles.skipped_bytes == 0
