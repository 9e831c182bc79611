"""Int8 activations in the int16 products (csrc/src/tiles.cpp, prefill_i16.cpp; opt-in:
MLXINFER_INT8_ACTIVATIONS=1, issue 47): x rounded to int8 per block of 32 inputs and AVX-512 VNNI's
``vpdpbusd``. Each output against the float64 definition within int8's rounding bound (derived in
``int16_definition.definition``) and, somewhere, outside int16's (so the int8 path ran), for
every width, group size, scale dtype and tail of rows, tiled or not; the setting read at load (off by default,
a bad value a one-line error, ``describe`` naming it); the real SmolLM2's decode choosing the
int16 path's greedy token (the default, tested against MLX's own in test_cpu_int16.py) wherever
that path's top two are apart."""

import mlx.core as mx
import numpy as np
import pytest
from int16_definition import definition, outlier_rows, random_tiled

from mlxinfer.backends import kernels
from mlxinfer.errors import ConfigError

K = kernels.load()
pytestmark = [
    pytest.mark.skipif(K is None, reason=f"compiled kernels absent: {kernels.reason()}"),
    pytest.mark.skipif(
        mx.default_device().type != mx.DeviceType.cpu, reason="the CPU backend's kernels"
    ),
    pytest.mark.skipif(
        K is not None and not K.tiles_int8_available(),
        reason="int8 activations need the tiles: AVX-512 with VNNI, or AVX2 (this CPU has neither)",
    ),
]


@pytest.fixture
def int8():
    """Int8 activations on for the test, off after (the default)."""
    K.set_int8_activations(True)
    yield
    K.set_int8_activations(False)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("half", [False, True])
def test_int8_products_are_within_their_rounding_bound(bits, group_size, half, int8):
    """1-17 rows (a pass is 8) against the float64 product: within int8's bound everywhere,
    outside int16's somewhere (the int8 path ran, not the default's); a zero row gives zeros."""
    if bits != 4 and not K.tiles_wide_vnni():
        pytest.skip("the AVX2 tiles take int8 at 4 bits only (this CPU has no AVX-512 VNNI)")
    rng = np.random.default_rng(bits * 100 + group_size + half)
    q, s, b, t = random_tiled(rng, bits, group_size, half)
    s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
    for M in (1, 2, 5, 8, 9, 17):
        x = outlier_rows(rng, M)
        if M > 2:
            x[2] = 0.0
        y = np.array(K.quantized_matvec(mx.array(x), *t, group_size, bits), np.float64)
        exact, bound = definition(x, q, s32, b32, group_size, bits, int8=True)
        _, bound16 = definition(x, q, s32, b32, group_size, bits)
        assert (np.abs(y - exact) <= bound).all(), (M, (np.abs(y - exact) / bound).max())
        assert not (np.abs(y - exact) <= bound16).all(), M
        if M > 2:
            assert (y[2] == 0).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_the_int16_products_round_x_to_int8_when_set(bits, group_size, int8):
    """``quantized_matmul_i16`` (the untiled layers' and the tied head's products: up to 4 rows
    each output row's codes as bytes, more through byte tiles): within int8's bound, outside
    int16's somewhere; inputs with a 32 tail past a multiple of 64 (the byte rows' padding)."""
    if not K.vnni_available():
        pytest.skip("quantized_matmul_i16 needs AVX-512 F, BW, VNNI and VBMI")
    rng = np.random.default_rng(bits * 1000 + group_size)
    for M, N, Kd in [(1, 32, 128), (3, 64, 416), (4, 32, 640), (5, 96, 416), (9, 64, 384)]:
        if Kd % group_size:
            continue
        w = mx.array(rng.normal(size=(N, Kd)).astype(np.float32) * 0.05)
        q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
        x = rng.normal(size=(M, Kd)).astype(np.float32)
        x[0, 3] = 40.0
        y = np.array(K.quantized_matmul_i16(mx.array(x), q, s, b, group_size, bits), np.float64)
        exact, bound = definition(x, q, s, b, group_size, bits, int8=True)
        _, bound16 = definition(x, q, s, b, group_size, bits)
        assert (np.abs(y - exact) <= bound).all(), (M, Kd, (np.abs(y - exact) / bound).max())
        assert not (np.abs(y - exact) <= bound16).all(), (M, Kd)


@pytest.mark.parametrize("cap", ["avx2", "avxvnni"])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_the_avx2_tiles_take_int8_at_4_bits_as_the_512_bit_path(cap, bits, int8):
    """Held at AVX2 (vpmaddubsw summed in int16 over a block; with AVX-VNNI, vpdpbusd): 4-bit
    layers give the 512-bit int8 path's outputs bit for bit (the same int32 sums and scaling);
    5-, 6- and 8-bit layers stay int16 there, the int16 path's outputs bit for bit."""
    if K.isa() != "avx512":
        pytest.skip("compares with the 512-bit path (this CPU's level is below AVX-512)")
    rng = np.random.default_rng(bits)
    try:
        K.set_max_isa(cap)
        if cap == "avxvnni" and not K.avx_vnni_available():
            pytest.skip("this CPU has no AVX-VNNI (avxvnni in /proc/cpuinfo)")
        assert K.tiles_int8_available() and not K.tiles_wide_available()
        for group_size, half in [(32, True), (64, False), (128, True)]:
            q, s, b, t = random_tiled(rng, bits, group_size, half)
            for M in (1, 2, 3, 9):
                x = mx.array(outlier_rows(rng, M))
                K.set_max_isa(cap)
                avx2 = np.array(K.quantized_matvec(x, *t, group_size, bits))
                if bits == 4:
                    K.set_max_isa("best")
                else:
                    K.set_int8_activations(False)
                want = np.array(K.quantized_matvec(x, *t, group_size, bits))
                K.set_int8_activations(True)
                assert (avx2 == want).all(), (group_size, M)
    finally:
        K.set_max_isa("best")


def test_a_non_finite_row_gives_nans_in_its_row_only(int8):
    rng = np.random.default_rng(5)
    q, s, b, t = random_tiled(rng, 4, 32, True)
    x = outlier_rows(rng, 3)
    x[1, 7] = np.inf
    y = np.array(K.quantized_matvec(mx.array(x), *t, 32, 4))
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()


@pytest.fixture
def fresh(monkeypatch):
    """kernels.load() re-run in the test; int8 activations off after."""
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.delenv(kernels.ENV, raising=False)
    yield monkeypatch
    K.set_int8_activations(False)


def test_the_setting_is_read_at_load_and_a_bad_value_is_one_line(fresh):
    """Off unless MLXINFER_INT8_ACTIVATIONS=1; ``describe`` (``-v``) names it and the plans'
    cache key tells it apart (plans timed on its products are not the default's); anything but
    0 or 1 is a ConfigError (the CLI's one-line error) naming the setting."""
    from mlxinfer.backends.cpu import compiled

    fresh.delenv(kernels.ENV_INT8, raising=False)
    assert not kernels.load().int8_activations()
    assert "int8" not in kernels.describe()
    default = compiled.key()
    fresh.setattr(kernels, "_loaded", None)
    fresh.setenv(kernels.ENV_INT8, "1")
    assert kernels.load().int8_activations()
    assert ", int8 activations on " in kernels.describe()
    assert compiled.key() == [*default, "int8"]
    fresh.setattr(kernels, "_loaded", None)
    fresh.setenv(kernels.ENV_INT8, "0")
    assert not kernels.load().int8_activations()
    fresh.setattr(kernels, "_loaded", None)
    fresh.setenv(kernels.ENV_INT8, "yes")
    with pytest.raises(ConfigError, match=r"^MLXINFER_INT8_ACTIVATIONS='yes': expected 0 or 1$"):
        kernels.load()


@pytest.mark.real
def test_smollm2_decodes_with_int8_activations_as_the_int16_path_outside_near_ties():
    """The real SmolLM2-135M (its GGUF's 4-bit layers tiled): a prompt and 24 steps of the
    default path's greedy decode, fed again with int8 activations. Every step's logits move (the
    int8 path ran) by at most 5 % of their spread, and the greedy token is the default's wherever
    the default's top two are over 1.0 apart (four prompts measured: the top two's gap moved by
    at most 0.46, top-1 agreed at 97 of 100 steps; a free-running decode can part at a near tie,
    as one did at a gap of 0.002). The perplexity cost is in docs/performance.md."""
    from fixtures import smollm2_mlx_dir

    from mlxinfer import load
    from mlxinfer.backends.cpu import compiled
    from mlxinfer.backends.cpu import plans as cpu_plans

    model, tokenizer = load(smollm2_mlx_dir())
    # the products int8 applies to: the tiles (int16_decode), a prompt's rows through them too
    plans = {**cpu_plans.forced_plans("kernels"), "int16_decode": "int16", "int16_rows": 8}
    cpu_plans.set_plans(model, plans)
    ids = tokenizer.encode("The three primary colours are red, yellow and")

    def run(on: bool, fed: list[int] | None) -> tuple[list[np.ndarray], list[int]]:
        K.set_int8_activations(on)
        try:
            cache = model.make_cache()
            steps = [np.array(model(mx.array([ids]), cache=cache)[0, -1])]
            tokens = []
            for i in range(24):
                tokens.append(int(np.argmax(steps[-1])) if fed is None else fed[i])
                steps.append(np.array(model(mx.array([tokens[-1:]]), cache=cache)[0, -1]))
            return steps, tokens
        finally:
            K.set_int8_activations(False)

    try:
        base, tokens = run(False, None)
        steps, _ = run(True, tokens)
    finally:
        compiled.set_int16_decode(False)  # process-wide: never left on for later tests
    for want, got in zip(base, steps):
        spread = want.max() - want.min()
        assert 1e-4 * spread < np.abs(got - want).max() < 0.05 * spread
        top = np.sort(want)[::-1]
        if top[0] - top[1] > 1.0:
            assert np.argmax(got) == np.argmax(want)


def test_the_engine_gives_each_prompt_its_tokens_alone_with_int8_activations(tmp_path, int8):
    """A tiny 4-bit Llama, its layers tiled (``int16_decode``) and a prompt's rows through them
    (``int16_rows``): with int8 activations each row's x is rounded by itself, so the batching
    engine's steps of 3 rows (prompts of 9, 23 and 14 tokens) give each prompt the tokens
    ``generate`` gives it alone, under the same setting."""
    from hf_models import add_tokenizer, make_tiny

    from mlxinfer.backends.cpu import compiled
    from mlxinfer.backends.cpu import plans as cpu_plans
    from mlxinfer.batch import Engine
    from mlxinfer.generation import generate_step
    from mlxinfer.loading.convert import convert
    from mlxinfer.loading.loader import load_model

    path, _ = make_tiny(tmp_path / "hf", perturb_vectors=True, model_type="llama")
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=4, group_size=32, dtype="float32")
    model, _ = load_model(tmp_path / "q")
    plans = {**cpu_plans.forced_plans("kernels"), "int16_decode": "int16", "int16_rows": 8}
    cpu_plans.set_plans(model, plans)
    try:
        prompts = [[(3 + 17 * i + 5 * n) % 256 for i in range(n)] for n in (9, 23, 14)]
        alone = [[t for t, _ in generate_step(p, model, max_tokens=6)] for p in prompts]
        with Engine(model, max_batch=4, prefill_step=64) as engine:
            handles = [engine.submit(p, max_tokens=6) for p in prompts]
            assert [[s.token for s in h.steps()] for h in handles] == alone
        assert any("_cpu_tiles" in m.__dict__ for m in model.modules())  # the tiles ran
    finally:
        compiled.set_int16_decode(False)  # process-wide: never left on for later tests
