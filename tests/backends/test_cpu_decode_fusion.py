"""The fused decode kernels (csrc/src/fused.cpp; issue 32, item 4 "fewer primitives per step"):
``rms_norm``, ``cache_write`` and ``decode_attention`` against numpy derivations and MLX's own
ops, the cache buffers updated in place only where MLX may donate them, and the ``decode``
plan in whole models: every decoded token's logits within 1e-3 of transformers and greedy
tokens identical, for the RoPE variants and attention options the kernel takes (GQA, per-head
q/k norms, a fused q/k/v projection with partial rotary, llama3 and dynamic NTK frequencies).
Every test forces the plan it checks."""

import mlx.core as mx
import numpy as np
import pytest
from hf_models import make_tiny, torch_greedy, torch_logits_chunked
from kernel_calls import CountedKernels, isa_levels

from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import attention_kernels, kinds
from mlxinfer.backends.cpu import plans as cpu_plans
from mlxinfer.batch import Engine
from mlxinfer.generation import generate_step
from mlxinfer.loading.loader import load_model
from mlxinfer.models.layers import GatedMLP

K = kernels.load()
pytestmark = [
    pytest.mark.skipif(K is None, reason=f"compiled kernels absent: {kernels.reason()}"),
    pytest.mark.skipif(
        mx.default_device().type != mx.DeviceType.cpu, reason="the CPU backend's kernels"
    ),
]
RNG = np.random.default_rng(0)
TOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}  # of max |reference|


def rand(*shape, dtype=mx.float32):
    return mx.array(RNG.standard_normal(shape).astype(np.float32)).astype(dtype)


def f32(a) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def rotate(x: np.ndarray, angles: np.ndarray, dims: int, traditional: bool) -> np.ndarray:
    """RoPE by its definition on (heads, D) rows: pair i is (2i, 2i+1) or (i, i + dims/2)."""
    x = x.copy()
    half = dims // 2
    for i, angle in enumerate(angles[:half]):
        a, b = (2 * i, 2 * i + 1) if traditional else (i, i + half)
        xa, xb = x[:, a].copy(), x[:, b].copy()
        x[:, a] = xa * np.cos(angle) - xb * np.sin(angle)
        x[:, b] = xb * np.cos(angle) + xa * np.sin(angle)
    return x


CASES = [  # n_q, n_kv, D, Dv, capacity, offset, dims, traditional, dtype
    (9, 3, 64, 64, 300, 17, 64, False, mx.float32),  # SmolLM2's heads
    (9, 3, 64, 64, 40, 0, 64, True, mx.float32),  # the first token
    (8, 2, 128, 128, 700, 699, 64, False, mx.float32),  # partial rotary, the buffer's last slot
    (4, 4, 32, 48, 40, 39, 32, True, mx.float32),  # no grouping, Dv != D
    (8, 1, 64, 64, 2100, 2050, 64, False, mx.float32),  # long: the heads on the pool
    (6, 3, 40, 40, 90, 70, 40, False, mx.float32),  # head dims not in 16s: the generic loops
    (9, 3, 64, 64, 300, 100, 64, False, mx.bfloat16),
    (9, 3, 64, 64, 300, 100, 64, False, mx.float16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:8])) + str(c[8])[-4:])
def test_cache_write_and_attention_match_their_definition_and_mlx_ops(case):
    n_q, n_kv, D, Dv, cap, offset, dims, trad, dtype = case
    q, k, v = (
        rand(1, 1, n_q * D, dtype=dtype),
        rand(1, 1, n_kv * D, dtype=dtype),
        rand(1, 1, n_kv * Dv, dtype=dtype),
    )
    keys, values = rand(1, n_kv, cap, D, dtype=dtype), rand(1, n_kv, cap, Dv, dtype=dtype)
    angles = RNG.uniform(0, 6, dims // 2).astype(np.float32)
    cos, sin = mx.array(np.cos(angles)), mx.array(np.sin(angles))
    K.set_num_threads(0)
    rope = {"offset": offset, "dims": dims, "traditional": trad}

    def attend(k2, v2, reference=False):
        return K.decode_attention(
            q, k2, v2, cos, sin, n_q=n_q, scale=D**-0.5, reference=reference, **rope
        )

    got = {}
    for reference in (False, True):
        k2 = K.cache_write(keys, k, cos, sin, reference=reference, **rope)
        v2 = K.cache_write(values, v, cos, sin, offset=offset, reference=reference)
        got[reference] = [f32(a) for a in (attend(k2, v2, reference), k2, v2)]
    # The definition, in float64 from the same (rounded) inputs.
    qr = rotate(f32(q).reshape(n_q, D).astype(np.float64), angles, dims, trad)
    kr = rotate(f32(k).reshape(n_kv, D).astype(np.float64), angles, dims, trad)
    K_, V_ = f32(keys)[0].astype(np.float64), f32(values)[0].astype(np.float64)
    K_[:, offset], V_[:, offset] = kr, f32(v).reshape(n_kv, Dv)
    want = []
    for j in range(n_q):
        h = j // (n_q // n_kv)
        s = (qr[j] * D**-0.5) @ K_[h, : offset + 1].T
        p = np.exp(s - s.max())
        want.append((p / p.sum()) @ V_[h, : offset + 1])
    want = np.concatenate(want)
    ours, mlx_ops = got[False], got[True]
    tol = TOL[dtype]
    assert np.abs(ours[0].ravel() - want).max() <= tol * np.abs(want).max()
    k2, v2 = (mx.array(a).astype(dtype) for a in ours[1:])
    try:  # every instruction-set path (f32 head dims in 16s: attention_simd.h's vectors)
        for level in isa_levels(K):
            K.set_max_isa(level)
            out = f32(attend(k2, v2))
            assert np.abs(out.ravel() - want).max() <= tol * np.abs(want).max(), level
    finally:
        K.set_max_isa("best")
    assert np.abs(ours[0] - mlx_ops[0]).max() <= tol * np.abs(want).max()
    for buf, ref, written in ((ours[1], mlx_ops[1], kr), (ours[2], mlx_ops[2], V_[:, offset])):
        assert np.array_equal(buf, ref)  # the same rounding, the other slots untouched
        assert np.abs(buf[0, :, offset] - written).max() <= tol * np.abs(written).max()
    before = f32(keys)
    assert np.array_equal(np.delete(ours[1], offset, axis=2), np.delete(before, offset, axis=2))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_rms_norm_matches_its_definition(dtype, rows):
    x, w = rand(rows, 1, 576, dtype=dtype), rand(576)
    got = f32(K.rms_norm(x, w, 1e-5))
    xf = f32(x).astype(np.float64)
    normed = xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-5)
    want = f32(mx.array(normed.astype(np.float32)).astype(dtype)) * f32(w)
    assert np.abs(got - want).max() <= TOL[dtype] * np.abs(want).max()
    assert np.allclose(got, f32(mx.fast.rms_norm(x, w, 1e-5)), atol=TOL[dtype] * np.abs(want).max())


def gelu_tanh(g):
    """GELU's tanh approximation as transformers' gelu_pytorch_tanh writes it (float64)."""
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("act", ["swiglu", "gelu_tanh_glu"])
@pytest.mark.parametrize("shape", [(1, 1, 1536), (8, 1, 1536), (3, 37), (128, 2048)])
def test_gated_kernels_match_their_definitions(shape, act):
    """silu(gate) * up and gelu_tanh(gate) * up against float64, on every instruction-set
    path, for gates from -120 to 120 (exp(-|t|) under- and overflows on either side), a tail
    of fewer than 16 values (37), a prefill's 128 rows (threaded), and gate and up read
    through strided views (the halves of one product). GELU within 3e-6 of the largest value:
    MLX's own gelu_approx is 2e-6 off on these."""
    both = RNG.standard_normal((*shape[:-1], 2 * shape[-1])).astype(np.float32) * 8
    both[..., :3] = [-120.0, 120.0, 0.0]
    both_mx = mx.array(both)
    gate, up = both_mx[..., : shape[-1]], both_mx[..., shape[-1] :]
    g, u = both[..., : shape[-1]].astype(np.float64), both[..., shape[-1] :].astype(np.float64)
    want = (g / (1 + np.exp(-g)) if act == "swiglu" else gelu_tanh(g)) * u
    tol = 1e-6 if act == "swiglu" else 3e-6
    runs = {}
    try:
        for level in isa_levels(K):
            K.set_max_isa(level)
            runs[level] = f32(getattr(K, act)(gate, up))
    finally:
        K.set_max_isa("best")
    for level, got in runs.items():
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), level
        if act == "swiglu":
            assert np.allclose(got, want, rtol=1e-6, atol=1e-30), level
    with pytest.raises(ValueError, match="gate, up: expected float32 arrays of one shape"):
        getattr(K, act)(gate, up[..., 1:])


def test_the_kernels_read_transposed_views():
    """Inputs whose last axis is not contiguous (transposed views) are read element by element
    along it: swiglu and rms_norm against their definitions."""
    a, b = rand(3, 40, 24), rand(3, 40, 24)
    gate, up = a.transpose(0, 2, 1), b.transpose(0, 2, 1)  # (3, 24, 40), last stride 24
    g, u = f32(gate).astype(np.float64), f32(up).astype(np.float64)
    want = g / (1 + np.exp(-g)) * u
    assert np.abs(f32(K.swiglu(gate, up)) - want).max() <= 1e-6 * np.abs(want).max()
    w = rand(40)
    normed = g / np.sqrt((g * g).mean(-1, keepdims=True) + 1e-5) * f32(w)
    assert np.abs(f32(K.rms_norm(gate, w, 1e-5)) - normed).max() <= 1e-5 * np.abs(normed).max()


def test_the_cache_buffer_is_updated_in_place_only_where_nobody_else_holds_it():
    n_kv, D = 2, 16
    keys = mx.zeros((1, n_kv, 8, D))
    mx.eval(keys)
    cos, sin = mx.ones((D // 2,)), mx.zeros((D // 2,))
    start = K.attention_buffer_copies()
    for offset in range(3):  # as a cache does: the buffer replaced by the written one
        keys = K.cache_write(keys, mx.full((1, 1, n_kv * D), offset + 1.0), cos, sin, offset=offset)
        mx.eval(keys)
    assert K.attention_buffer_copies() == start  # donated every time: no copy of the buffer
    held = keys  # somebody else keeps the buffer: it must not change under them
    written = K.cache_write(keys, mx.full((1, 1, n_kv * D), 9.0), cos, sin, offset=3)
    mx.eval(written)
    assert K.attention_buffer_copies() == start + 1
    assert float(held[0, 0, 3, 0]) == 0.0 and float(written[0, 0, 3, 0]) == 9.0
    assert f32(written)[0, :, :3].tolist() == f32(held)[0, :, :3].tolist()


def test_bad_arguments_are_value_errors_naming_them():
    keys, cos = mx.zeros((1, 2, 8, 16)), mx.ones((8,))
    with pytest.raises(ValueError, match="offset"):
        K.cache_write(keys, mx.zeros((32,)), cos, cos, offset=8)
    with pytest.raises(ValueError, match="x: expected one token's 2 x 16"):
        K.cache_write(keys, mx.zeros((31,)), cos, cos, offset=0)
    with pytest.raises(ValueError, match="heads"):
        K.decode_attention(
            mx.zeros((48,)), keys, keys, cos, cos, n_q=3, offset=0, scale=1.0, dims=16
        )
    with pytest.raises(ValueError, match="rope"):
        K.decode_attention(
            mx.zeros((64,)), keys, keys, cos, cos, n_q=4, offset=0, scale=1.0, dims=18
        )
    with pytest.raises(ValueError, match="w: expected a float array of shape \\(16,\\)"):
        K.rms_norm(mx.zeros((1, 16)), mx.zeros((15,)), 1e-5)


# Whole models: tiny random checkpoints, each decoded token by token through the cache.
SHAPES = dict(num_hidden_layers=2, vocab_size=512)
FAMILIES = {
    "llama": dict(model_type="llama"),
    "llama3-rope": dict(
        model_type="llama",
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "dynamic-ntk": dict(
        model_type="llama",
        rope_scaling=dict(rope_type="dynamic", factor=2.0),
        max_position_embeddings=16,
    ),
    "qwen3": dict(model_type="qwen3", head_dim=32),  # per-head q/k norms
    "phi3-partial": dict(
        model_type="phi3", partial_rotary_factor=0.5, pad_token_id=0
    ),  # fused qkv_proj
    # a sliding window of 6 (rotating caches; the 20 tokens wrap the ring three times)
    "mistral-window": dict(model_type="mistral", sliding_window=6),
}
IDS = [(5 + 37 * i) % 512 for i in range(20)]


def Counting(module) -> CountedKernels:
    names = ("rms_norm", "cache_write", "decode_attention", "paged_attention", "swiglu")
    return CountedKernels(module, names)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_with_the_fused_kernels_matches_transformers(family, tmp_path, monkeypatch):
    path, torch_model = make_tiny(
        tmp_path / "m", perturb_vectors=True, **{**SHAPES, **FAMILIES[family]}
    )
    model, _ = load_model(path)
    attention = [m for m in model.modules() if attention_kernels.attention_fits(m)]
    assert len(attention) == SHAPES["num_hidden_layers"]
    mlps = sum(isinstance(m, GatedMLP) for m in model.modules())  # phi3's fused MLP: its own
    assert mlps == (0 if family.startswith("phi3") else SHAPES["num_hidden_layers"])
    assert {"decode"} <= set(cpu_plans.plan_layers(model)) and cpu_plans.plan_layers(model)[
        "decode"
    ]
    ref = torch_logits_chunked(torch_model, [[t] for t in IDS])  # its cache, a token a step
    greedy = torch_greedy(torch_model, IDS[:4], 10)
    counter = Counting(K)
    monkeypatch.setattr(kernels, "load", lambda: counter)
    for option in ("kernel", "ops"):
        kinds.set_plan(model, "decode", option)
        cache = model.make_cache()
        rows = [np.array(model(mx.array([[t]]), cache)[0, -1]) for t in IDS]  # one token a step
        assert np.abs(np.stack(rows) - ref).max() <= 1e-3, option
        ours = [t for t, _ in generate_step(IDS[:4], model, max_tokens=10, prefill_step_size=2)]
        assert ours == greedy, option
        calls, counter.calls = counter.calls, dict.fromkeys(counter.calls, 0)
        # every token after the first; generate_step: the 1-token prefill chunk and 10 steps
        steps = len(IDS) - 1 + 1 + 10
        layers = SHAPES["num_hidden_layers"]
        on = option == "kernel"
        assert calls["decode_attention"] == steps * layers * on
        assert calls["cache_write"] == 2 * steps * layers * on
        assert calls["rms_norm"] >= steps * (2 * layers + 1) * on
        assert calls["swiglu"] >= steps * mlps * on  # the shared gated MLPs' SwiGLU too


def test_decode_over_a_cache_that_keeps_its_first_tokens(tmp_path, monkeypatch):
    """``--max-kv-size 8``: rotating caches that keep the first 4 tokens (the ring wraps to
    slot 4). The kernels write at the ring's slot and attend over every stored entry: the
    logits of 20 tokens, one a step, as the ops path's (whose eviction tests/cache checks
    against its definition), and the kernels ran every step."""
    path, _ = make_tiny(tmp_path / "m", perturb_vectors=True, **{**SHAPES, "model_type": "llama"})
    model, _ = load_model(path)
    counter = Counting(K)
    monkeypatch.setattr(kernels, "load", lambda: counter)
    rows = {}
    for option in ("kernel", "ops"):
        kinds.set_plan(model, "decode", option)
        cache = model.make_cache(max_kv_size=8)
        first = model(mx.array([IDS[:3]]), cache)  # a prompt, then a token a step
        rows[option] = [np.array(first[0, -1])] + [
            np.array(model(mx.array([[t]]), cache)[0, -1]) for t in IDS[3:]
        ]
    assert np.abs(np.stack(rows["kernel"]) - np.stack(rows["ops"])).max() <= 1e-4
    assert counter.calls["decode_attention"] == (len(IDS) - 3) * SHAPES["num_hidden_layers"]


def test_the_decode_plan_is_offered_only_with_the_kernels(tmp_path, monkeypatch):
    path, _ = make_tiny(tmp_path / "m", **SHAPES)
    model, _ = load_model(path)
    assert "kernel" in kinds.options_of(model, "decode")
    monkeypatch.setattr(kernels, "load", lambda: None)
    plain, _ = load_model(path)
    assert not cpu_plans.plan_layers(plain)["decode"]
    assert not any(attention_kernels.attention_fits(m) for m in plain.modules())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 9, 3, 64, 16, 5),
        (3, 8, 2, 32, 32, 4),
        (2, 4, 4, 16, 8, 1),
        (2, 6, 3, 40, 8, 3),
        (2, 12, 2, 48, 6, 3),  # 6 heads a KV head (4 + 2), blocks of 6: the vector tails
        # one row over few KV heads: each head's blocks attended in parts on the threads, joined
        (1, 9, 3, 64, 16, 24),
        (1, 4, 1, 64, 16, 40),
        (1, 4, 1, 64, 16, 40, 100),  # 100 tokens seen of 640: the later parts see none
        (1, 4, 1, 64, 512, 1, 300),  # one block a head (a plain cache): cut into sub-blocks
        (1, 4, 1, 64, 525, 1, 500),  # a capacity of any length: 5 sub-blocks of 105
        (2, 4, 1, 64, 16, 12),  # two rows of one KV head: each row's parts, its own keys seen
    ],
)
def test_paged_attention_matches_its_definition_and_mlx_ops(shape, dtype):
    """Rows of a batch over pool blocks in any order, each seeing its own keys (the last block
    partly, padding blocks not at all), against the definition and MLX's ops, on every
    instruction-set path (float32 head dims that are multiples of 16 take the vector path of
    attention_simd.h; 40 the generic loops). The hidden slots hold NaN: never read into y."""
    B, n_q, n_kv, D, block, n, *seen_only = shape
    n_blocks = B * n + 3
    keys, values = (
        rand(n_blocks, n_kv, block, D, dtype=dtype),
        rand(n_blocks, n_kv, block, D, dtype=dtype),
    )
    q = rand(B, n_q, 1, D, dtype=dtype)
    order = RNG.permutation(n_blocks)[: B * n].reshape(B, n)
    lengths = [max(1, n * block - 3 * b - (block // 2) * (b % 2)) for b in range(B)]
    lengths = [seen_only[0]] * B if seen_only else lengths
    table = np.stack([order * n_kv + h for h in range(n_kv)], axis=1).astype(
        np.uint32
    )  # (B, n_kv, n)
    seen = np.zeros((B, n * block), bool)
    for b, length in enumerate(lengths):
        seen[b, :length] = True
    visible = mx.array(seen.reshape(B, 1, n, 1, block))
    args = (q, keys, values, mx.array(table), visible)
    mlx_ops = f32(K.paged_attention(*args, scale=D**-0.5, reference=True))
    kf, vf, qf = f32(keys), f32(values), f32(q)
    hidden_k, hidden_v = kf.copy(), vf.copy()
    for b in range(B):  # NaN in every slot row b does not see, in its own blocks and the rest
        flat = seen[b].reshape(n, block)
        for i, blk in enumerate(order[b]):
            hidden_k[blk][:, ~flat[i]] = np.nan
            hidden_v[blk][:, ~flat[i]] = np.nan
    unused = np.setdiff1d(np.arange(n_blocks), order)
    hidden_k[unused], hidden_v[unused] = np.nan, np.nan
    nan_args = (q, mx.array(hidden_k).astype(dtype), mx.array(hidden_v).astype(dtype), *args[3:])
    runs = {}
    try:
        for level in isa_levels(K):
            K.set_max_isa(level)
            runs[level] = f32(K.paged_attention(*args, scale=D**-0.5))
            runs[level + " (NaN hidden)"] = f32(K.paged_attention(*nan_args, scale=D**-0.5))
    finally:
        K.set_max_isa("best")
    want = np.zeros((B, n_q, 1, D))
    for b in range(B):
        for j in range(n_q):
            h = j // (n_q // n_kv)
            K_ = np.concatenate([kf[i, h] for i in order[b]])[seen[b]]
            V_ = np.concatenate([vf[i, h] for i in order[b]])[seen[b]]
            s = (qf[b, j, 0] * D**-0.5) @ K_.T
            p = np.exp(s - s.max())
            want[b, j, 0] = (p / p.sum()) @ V_
    tol = TOL[dtype] * np.abs(want).max()
    assert np.abs(mlx_ops - want).max() <= tol
    for level, ours in runs.items():
        assert np.abs(ours - want).max() <= tol, level
        assert np.abs(ours - mlx_ops).max() <= tol, level


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-window"])
def test_the_batching_engine_decodes_over_pages_with_the_kernel(family, tmp_path, monkeypatch):
    """The engine's decode steps (the "pages" form: rows of mixed lengths, joined mid-batch) with
    the decode plan on (q and k rotated at each row's position and the keys written as rows
    by the backend, ``attention_kernels.paged_decode_attention``; a sliding window's pool too): each
    row's greedy tokens transformers' for its prompt alone, and one paged-attention call per
    attention layer and step."""
    path, torch_model = make_tiny(
        tmp_path / "m", perturb_vectors=True, **{**SHAPES, **FAMILIES[family]}
    )
    model, _ = load_model(path)
    prompts = [[(3 + 17 * i + 5 * n) % 512 for i in range(n)] for n in (5, 40, 19)]
    expected = [torch_greedy(torch_model, p, 6) for p in prompts]
    counter = Counting(K)
    monkeypatch.setattr(kernels, "load", lambda: counter)
    kinds.set_plan(model, "decode", "kernel")
    with Engine(model, max_batch=4, block_size=16) as engine:
        handles = [engine.submit(p, max_tokens=6) for p in prompts]
        got = [[s.token for s in h.steps(timeout=60)] for h in handles]
        steps = engine.steps_run
    assert got == expected
    assert 0 < counter.calls["paged_attention"] <= steps * SHAPES["num_hidden_layers"]


def unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """mx.quantize's packed uint32 words as their codes, low bits first (its definition)."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(*words.shape[:-1], -1).astype(np.float64)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "shape",  # B, n_q, n_kv, D, block, n, group_size
    [
        (3, 9, 3, 64, 16, 5, 64),
        (2, 8, 2, 128, 8, 4, 32),
        (2, 6, 3, 64, 7, 3, 32),
        (1, 9, 3, 64, 16, 24, 32),  # one row of few KV heads: its blocks attended in parts
        (1, 4, 1, 64, 16, 40, 64),
        (1, 4, 1, 64, 512, 1, 64),  # a plain cache's one block a head: cut into sub-blocks
        (2, 4, 1, 64, 16, 12, 64),  # two rows of one KV head, in parts
    ],
)
def test_quantized_paged_attention_matches_its_definition(bits, shape):
    """A quantized pool's pages (kv_bits: mx.quantize's codes, scales and biases) read by the
    kernel, each part dequantized as it is loaded: rows over blocks in any order, each seeing
    its own keys, against the definition in float64 (the codes unpacked from their words) and
    the model path's gather_qmm, on every instruction-set path. The hidden slots' scales and
    biases are NaN: never read into y."""
    from mlxinfer.batch.views import _page_index
    from mlxinfer.cache.kv import Pages
    from mlxinfer.models.layers.attention import paged_attention as model_paged_attention

    B, n_q, n_kv, D, block, n, gs = shape
    n_blocks = B * n + 2
    sides = [mx.quantize(rand(n_blocks, n_kv, block, D), group_size=gs, bits=bits) for _ in "kv"]
    q = rand(B, n_q, 1, D)
    order = RNG.permutation(n_blocks)[: B * n].reshape(B, n)
    table = np.stack([order * n_kv + h for h in range(n_kv)], axis=1).astype(np.uint32)
    seen = np.zeros((B, n * block), bool)
    for b in range(B):
        seen[b, : max(1, n * block - 5 * b - 2)] = True
    visible = mx.array(seen.reshape(B, 1, n, 1, block))
    deq = [  # (n_blocks, n_kv, block, D) float64
        unpack(np.array(w), bits) * np.repeat(np.array(s, np.float64), gs, -1)
        + np.repeat(np.array(c, np.float64), gs, -1)
        for w, s, c in sides
    ]
    want = np.zeros((B, n_q, 1, D))
    for b in range(B):
        for j in range(n_q):
            h = j // (n_q // n_kv)
            K_ = np.concatenate([deq[0][i, h] for i in order[b]])[seen[b]]
            V_ = np.concatenate([deq[1][i, h] for i in order[b]])[seen[b]]
            s = (np.array(q, np.float64)[b, j, 0] * D**-0.5) @ K_.T
            p = np.exp(s - s.max())
            want[b, j, 0] = (p / p.sum()) @ V_
    hidden = []  # NaN scales and biases in every slot no row sees
    mask = np.ones((n_blocks, block), bool)
    for b in range(B):
        mask[order[b]] &= ~seen[b].reshape(n, block)
    for w, s, c in sides:
        s, c = (np.where(mask[:, None, :, None], np.nan, np.array(a)) for a in (s, c))
        hidden.append([w, mx.array(s.astype(np.float32)), mx.array(c.astype(np.float32))])
    tol = 1e-5 * np.abs(want).max()
    pages = Pages(*sides, *_page_index(order, n_kv), visible, bits, gs)
    plain = f32(model_paged_attention(q, pages, scale=D**-0.5))
    assert np.abs(plain - want).max() <= tol
    try:
        for level in isa_levels(K):
            K.set_max_isa(level)
            for kv in (sides, hidden):
                ours = f32(
                    K.paged_attention_quantized(
                        q, *kv, mx.array(table), visible, scale=D**-0.5, group_size=gs, bits=bits
                    )
                )
                assert np.abs(ours - want).max() <= tol, level
    finally:
        K.set_max_isa("best")


def test_quantized_paged_attention_refuses_what_it_cannot_read():
    keys = list(mx.quantize(rand(4, 2, 8, 64), group_size=64, bits=8))
    args = (
        rand(1, 4, 1, 64),
        keys,
        keys,
        mx.zeros((1, 2, 1), mx.uint32),
        mx.ones((1, 1, 1, 1, 8), mx.bool_),
    )
    with pytest.raises(ValueError, match="bits: expected 4 or 8, found 3"):
        K.paged_attention_quantized(*args, scale=1.0, group_size=64, bits=3)
    with pytest.raises(
        ValueError, match="group_size: expected a power of two of 16 or more, found 48"
    ):
        K.paged_attention_quantized(*args, scale=1.0, group_size=48, bits=8)
    qkv, rows, empty = rand(1, 1, 6 * 64), mx.zeros((2,), mx.uint32), mx.zeros((1, 0))
    with pytest.raises(
        ValueError, match=r"values: expected float32 scales \(4, 2, 8, 1\), found \(4, 1"
    ):
        K.pool_write(keys, [keys[0], keys[1][:, :1], keys[2]], qkv, rows, empty, empty,
                     k_start=0, v_start=0, group_size=64, bits=8)  # fmt: skip
    half = [keys[0], keys[1].astype(mx.float16), keys[2]]
    with pytest.raises(ValueError, match="keys: expected float32 scales"):
        K.paged_attention_quantized(
            args[0], half, keys, *args[3:], scale=1.0, group_size=64, bits=8
        )


@pytest.mark.parametrize("bits", [8, 4])
def test_decode_over_a_quantized_cache_reads_it_with_the_kernel(bits, tmp_path, monkeypatch):
    """``--kv-bits``: a ``QuantizedKVCache``'s decode tokens read by the quantized pages' kernel
    (the cache's buffers as one block per KV head, past its tokens hidden), under the decode
    plan: every token's logits those of the model path (MLX's quantized matmul over the same
    codes), 1e-4, with the kernel called once a layer and token."""
    path, _ = make_tiny(tmp_path / "m", perturb_vectors=True, head_dim=64, **SHAPES)
    model, _ = load_model(path)
    counter = CountedKernels(K, ("paged_attention_quantized",))
    monkeypatch.setattr(kernels, "load", lambda: counter)
    rows = {}
    for option in ("kernel", "ops"):
        kinds.set_plan(model, "decode", option)
        cache = model.make_cache(kv_bits=bits)
        first = model(mx.array([IDS[:7]]), cache)  # a prompt, then a token a step
        rows[option] = [np.array(first[0, -1])] + [
            np.array(model(mx.array([[t]]), cache)[0, -1]) for t in IDS[7:]
        ]
    assert np.abs(np.stack(rows["kernel"]) - np.stack(rows["ops"])).max() <= 1e-4
    calls = counter.calls["paged_attention_quantized"]
    assert calls == (len(IDS) - 7) * SHAPES["num_hidden_layers"]
