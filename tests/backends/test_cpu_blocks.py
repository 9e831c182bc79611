"""A decode step's block as the fused kernels (backends/cpu/blocks.py, csrc/src/block.cpp;
issue 47, item 2 "fewer, larger primitives per decode step"): quantized tiny models decoded a
token a step give the separate kernels' logits bit for bit and MLX's own quantized path's
within its bound, and the same greedy tokens, for the block forms the fused path takes —
Llama (tied, q/k/v and gate/up stacked), Qwen3 (per-head q/k norms), Gemma-3 (post-norms,
GELU, sliding windows over rotating caches, every sixth layer global) and a Llama whose
layers differ in format (q/k/v and gate/up not stackable: each its own product). The fused
kernels ran every block of every step; the batching engine's steps over its pool's pages too
(each row's tokens MLX's for its prompt alone); bad arguments are one-line errors."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hf_models import add_tokenizer, make_tiny
from kernel_calls import CountedKernels, isa_levels
from safetensors.numpy import load_file, save_file

from mlxinfer import backends
from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import blocks
from mlxinfer.backends.cpu import plans as cpu_plans
from mlxinfer.batch import Engine
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
        K is not None and not hasattr(K, "mlp_output"), reason="kernels built before block.cpp"
    ),
]

FAMILIES = {
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "gemma3-window": dict(
        model_type="gemma3_text",
        head_dim=16,
        num_hidden_layers=7,  # six sliding layers and a global one
        sliding_window=6,  # the 20 tokens wrap each ring
        query_pre_attn_scalar=16,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
    "llama-mixed": dict(model_type="llama"),
}
IDS = [(5 + 37 * i) % 256 for i in range(20)]


NAMES = ("norm_products", "pool_write", "attention_output", "mlp_output", "fuse")  # a block's


def Counting(module, names=NAMES) -> CountedKernels:
    return CountedKernels(module, names)


def mix_formats(q: Path) -> None:
    """Re-quantize layer 0's k_proj at 8 bits, group 64, and its up_proj at 5 bits, group 32,
    recorded per layer as mlx-lm writes them: q/k/v and gate/up then differ in format."""
    path = q / "model.safetensors"
    tensors = load_file(path)
    config = json.loads((q / "config.json").read_text())
    record = config["quantization"]
    for name, bits, group in (("self_attn.k_proj", 8, 64), ("mlp.up_proj", 5, 32)):
        key = f"model.layers.0.{name}"
        w = mx.dequantize(
            mx.array(tensors[f"{key}.weight"]),
            mx.array(tensors[f"{key}.scales"]),
            mx.array(tensors[f"{key}.biases"]),
            group_size=record["group_size"],
            bits=record["bits"],
        )
        codes, scales, biases = mx.quantize(w, group_size=group, bits=bits)
        for part, a in (("weight", codes), ("scales", scales), ("biases", biases)):
            tensors[f"{key}.{part}"] = np.array(a)
        record[key] = {"group_size": group, "bits": bits}
    save_file(tensors, path, metadata={"format": "mlx"})
    (q / "config.json").write_text(json.dumps(config))
    (q / "mlxinfer-manifest.json").unlink()  # its sizes are the uniform files' (mlx-lm has none)


def step_logits(model) -> np.ndarray:
    cache = model.make_cache()
    rows = [np.array(model(mx.array([IDS[:3]]), cache)[0, -1])]
    rows += [np.array(model(mx.array([[t]]), cache)[0, -1]) for t in IDS[3:]]
    return np.stack(rows)


def greedy(model) -> list[int]:
    return [t for t, _ in generate_step(IDS[:4], model, max_tokens=10, prefill_step_size=2)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_blocks_give_the_separate_kernels_logits(family, tmp_path, monkeypatch):
    path, _ = make_tiny(tmp_path / "hf", perturb_vectors=True, **FAMILIES[family])
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=4, group_size=32, dtype="float32")
    if family == "llama-mixed":
        mix_formats(tmp_path / "q")
    monkeypatch.setenv(backends.ENV, "0")  # MLX's own layers and quantized_matmul
    plain, _ = load_model(tmp_path / "q")
    monkeypatch.delenv(backends.ENV)
    reference, reference_greedy = step_logits(plain), greedy(plain)
    counter = Counting(K)
    monkeypatch.setattr(kernels, "load", lambda: counter)
    model, _ = load_model(tmp_path / "q")
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    layers = len(model.layers)
    assert sum(isinstance(m, blocks.CPUDecodeBlock) for m in model.modules()) == layers
    out = {}
    for on in (True, False):
        monkeypatch.setattr(blocks, "ON", on)
        copies = K.attention_buffer_copies()
        out[on] = step_logits(model)
        assert greedy(model) == reference_greedy, on
        assert K.attention_buffer_copies() == copies  # the caches written in place
        calls, counter.calls = counter.calls, dict.fromkeys(NAMES, 0)
        # the tokens a step, then generate_step's: its prompt's 1-token chunk and 10 steps
        steps = len(IDS) - 3 + 1 + 10
        assert calls == dict.fromkeys(NAMES, steps * layers * on), on
    assert np.array_equal(out[True], out[False])  # the same arithmetic, bit for bit
    monkeypatch.setattr(blocks, "ON", True)
    monkeypatch.setattr(blocks, "FUSE", False)  # the four calls as four nodes, not one
    assert np.array_equal(step_logits(model), out[True])
    monkeypatch.setattr(blocks, "FUSE", True)
    bound = 1e-4 * np.abs(reference).max()  # the kernels' products against MLX's
    assert np.abs(out[True] - reference).max() <= bound
    if family == "llama-mixed":  # 4-, 5- and 8-bit products: each instruction-set path too
        try:
            for level in isa_levels(K):
                K.set_max_isa(level)
                for on in (True, False):
                    monkeypatch.setattr(blocks, "ON", on)
                    out[on] = step_logits(model)
                assert np.array_equal(out[True], out[False]), level
                assert np.abs(out[True] - reference).max() <= bound, level
        finally:
            K.set_max_isa("best")


def test_replaced_weights_and_plans_are_seen_at_the_next_step(tmp_path, monkeypatch):
    """The fused blocks keep what they read of a block between steps: a norm weight or an
    output projection replaced afterwards, or the decode plan set to ``ops``, is seen at the
    next step (the logits the separate kernels give with the new weights; no fused call)."""
    path, _ = make_tiny(tmp_path / "hf", perturb_vectors=True, model_type="llama")
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=4, group_size=32, dtype="float32")
    counter = Counting(K)
    monkeypatch.setattr(kernels, "load", lambda: counter)
    model, _ = load_model(tmp_path / "q")
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    before = step_logits(model)
    block = model.layers[1]
    block.post_attention_layernorm.weight = block.post_attention_layernorm.weight * 1.5
    o = block.self_attn.o_proj
    o.scales = o.scales * 0.5
    out = {}
    for on in (True, False):
        monkeypatch.setattr(blocks, "ON", on)
        out[on] = step_logits(model)
    assert np.array_equal(out[True], out[False])
    assert np.abs(out[True] - before).max() > 1e-2  # the new weights changed the logits
    counter.calls = dict.fromkeys(NAMES, 0)
    cpu_plans.set_plans(model, {**cpu_plans.forced_plans("kernels"), "decode": "ops"})
    monkeypatch.setattr(blocks, "ON", True)
    step_logits(model)
    assert counter.calls == dict.fromkeys(NAMES, 0)


ENGINE_CALLS = ("norm_products", "pool_write", "paged_attention_output", "mlp_output", "fuse")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_batching_engine_runs_fused_blocks_over_its_pages(family, tmp_path, monkeypatch):
    """The engine's decode steps (rows of mixed lengths joined mid-batch; Gemma's sliding
    layers over a window pool): each row's greedy tokens MLX's own quantized path's for its
    prompt alone, the same with the fused blocks off, and every block of every decode step
    fused (its keys and values written into the pool by one ``pool_write`` a layer, the block
    one node of MLX's graph)."""
    path, _ = make_tiny(tmp_path / "hf", perturb_vectors=True, **FAMILIES[family])
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=4, group_size=32, dtype="float32")
    if family == "llama-mixed":
        mix_formats(tmp_path / "q")
    prompts = [[(3 + 17 * i + 5 * n) % 256 for i in range(n)] for n in (5, 40, 19)]
    monkeypatch.setenv(backends.ENV, "0")
    plain, _ = load_model(tmp_path / "q")
    monkeypatch.delenv(backends.ENV)
    expected = [[t for t, _ in generate_step(p, plain, max_tokens=6)] for p in prompts]
    counter = Counting(K, ENGINE_CALLS)
    monkeypatch.setattr(kernels, "load", lambda: counter)
    model, _ = load_model(tmp_path / "q")
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    layers = len(model.layers)
    for on in (True, False):
        monkeypatch.setattr(blocks, "ON", on)
        counter.calls = dict.fromkeys(ENGINE_CALLS, 0)
        copies = K.attention_buffer_copies()
        with Engine(model, max_batch=4, block_size=16) as engine:
            handles = [engine.submit(p, max_tokens=6) for p in prompts]
            got = [[s.token for s in h.steps(timeout=60)] for h in handles]
        assert got == expected, on
        assert K.attention_buffer_copies() == copies  # the pool written in place, never copied
        calls = counter.calls
        assert calls["pool_write"] == calls["paged_attention_output"], on
        assert calls["mlp_output"] == calls["paged_attention_output"], on
        assert calls["fuse"] == calls["paged_attention_output"], on  # each block one node
        # a decode step of every row: each prompt's 5 tokens after its first, in steps of up to
        # 3 rows, so at least 5 steps and at most 15, each of every layer
        assert 5 * layers * on <= calls["paged_attention_output"] <= 15 * layers * on, on
        assert calls["paged_attention_output"] % layers == 0, on
    counter.calls = dict.fromkeys(ENGINE_CALLS, 0)  # a lone row: each block one graph node
    monkeypatch.setattr(blocks, "ON", True)
    with Engine(model, max_batch=4, block_size=16) as engine:
        got = [s.token for s in engine.submit(prompts[1], max_tokens=6).steps(timeout=60)]
    assert got == expected[1]
    assert K.attention_buffer_copies() == copies  # the pool written in place by the fused node
    calls = counter.calls
    # 5 decode steps after the first token (6 where the prompt's last token is one too)
    assert calls["fuse"] == calls["paged_attention_output"] in (5 * layers, 6 * layers)


def test_a_block_outside_the_fused_forms_keeps_its_own_forward(tmp_path, monkeypatch):
    """A float model (the fused kernels take quantized products only) and a bfloat16 token:
    the block's own forward, never a fused call."""
    path, _ = make_tiny(tmp_path / "hf", model_type="llama")
    counter = Counting(K)
    monkeypatch.setattr(kernels, "load", lambda: counter)
    model, _ = load_model(path)
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    step_logits(model)
    assert counter.calls == dict.fromkeys(NAMES, 0)


def test_bad_arguments_are_one_line_value_errors():
    x, norm = mx.zeros((1, 1, 64)), mx.ones((64,))
    codes, scales, biases = mx.quantize(mx.zeros((96, 64)), group_size=32, bits=4)
    layer = (codes, scales, biases, 32, 4)
    with pytest.raises(ValueError, match=r"\[mlxinfer norm_products\] norm: expected"):
        K.norm_products(x, mx.ones((63,)), 1e-5, [layer])
    with pytest.raises(ValueError, match=r"layers\[0\] bits: expected 2, 3, 4, 5, 6 or 8"):
        K.norm_products(x, norm, 1e-5, [(codes, scales, biases, 32, 7)])
    with pytest.raises(ValueError, match=r"x: expected a float32 array"):
        K.norm_products(x.astype(mx.bfloat16), norm, 1e-5, [layer])
    with pytest.raises(ValueError, match=r"q_norm/k_norm: expected both"):
        K.norm_products(x, norm, 1e-5, [layer], q_norm=mx.ones((16,)), head_dim=16)
    gate = mx.quantize(mx.zeros((48, 64)), group_size=32, bits=4)
    with pytest.raises(ValueError, match=r"gate_up: expected gate and up of one width"):
        K.mlp_output(x, norm, 1e-5, [layer, (*gate, 32, 4)], layer)
    with pytest.raises(ValueError, match=r"down w: expected \(N, 6\) uint32 codes for 48 inputs"):
        K.mlp_output(x, norm, 1e-5, [layer], layer)  # its 64 inputs, not gate | up's 96 / 2
    keys = mx.zeros((1, 2, 8, 16))
    o = (*mx.quantize(mx.zeros((64, 64)), group_size=32, bits=4), 32, 4)
    cos = mx.ones((8,))
    with pytest.raises(ValueError, match=r"keys/values: expected \(1, 2, capacity > offset 8"):
        K.attention_output(
            x, mx.zeros((1, 1, 128)), keys, keys, cos, cos, o, n_q=4, offset=8, scale=1.0, dims=16
        )
    with pytest.raises(ValueError, match=r"x: expected one token's 2 x 16 values from element 64"):
        K.cache_write(keys, mx.zeros((1, 1, 80)), cos, cos, offset=0, start=64)
    pool = mx.zeros((4, 2, 8, 16))  # the engine's: (n_blocks, n_kv, block, head_dim)
    rows = mx.zeros((4,), dtype=mx.uint32)
    with pytest.raises(ValueError, match=r"\[mlxinfer pool_write\] rows: expected 4 uint32"):
        K.pool_write(
            pool, pool, mx.zeros((2, 1, 128)), mx.zeros((3,), mx.uint32), cos, cos, k_start=64,
            v_start=96,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"pool_write\] rope: expected an even dims <= 16"):
        K.pool_write(pool, pool, mx.zeros((2, 1, 128)), rows, cos, cos, k_start=64, v_start=96,
                     dims=16)  # fmt: skip
    with pytest.raises(ValueError, match=r"pool_write\] v_start: expected 2 x 16 values a row"):
        K.pool_write(pool, pool, mx.zeros((2, 1, 128)), rows, cos, cos, k_start=64, v_start=100)
    blocks = mx.zeros((2, 2, 3), dtype=mx.uint32)
    visible = mx.zeros((2, 1, 3, 1, 8), dtype=mx.bool_)
    x2, qkv2 = mx.zeros((2, 1, 64)), mx.zeros((2, 1, 128))
    with pytest.raises(ValueError, match=r"paged_attention_output\] visible: expected a \(2, 1, 3"):
        K.paged_attention_output(
            x2, qkv2, pool, pool, blocks, visible[:, :, :2], cos, cos, o, n_q=4, scale=1.0, dims=0
        )
    with pytest.raises(ValueError, match=r"paged_attention_output\] n_q: expected a multiple"):
        K.paged_attention_output(
            x2, qkv2, pool, pool, blocks, visible, cos, cos, o, n_q=3, scale=1.0, dims=0
        )
    packed = list(mx.quantize(mx.zeros((4, 2, 8, 64)), group_size=64, bits=8))
    with pytest.raises(ValueError, match=r"keys: expected \[packed, scales, biases\], found 1"):
        K.paged_attention_output(  # kv_bits with a float pool
            x2, qkv2, pool, pool, blocks, visible, cos, cos, o, n_q=4, scale=1.0, dims=0, kv_bits=8
        )
    with pytest.raises(ValueError, match=r"keys/values: expected one float pool each, found 3"):
        K.paged_attention_output(  # a quantized pool without kv_bits
            x2, qkv2, packed, packed, blocks, visible, cos, cos, o, n_q=4, scale=1.0, dims=0
        )
    with pytest.raises(ValueError, match=r"pool_write\] keys: expected \(n_blocks, n_kv, block, w"):
        K.pool_write(packed[1:] + packed[:1], packed, qkv2, rows, cos, cos, k_start=0,
                     v_start=0, bits=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"pool_write\] keys/values: expected one float pool each"):
        K.pool_write(packed, packed, qkv2, rows, cos, cos, k_start=0, v_start=0)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_batching_engine_runs_fused_blocks_over_a_quantized_pool(bits, tmp_path, monkeypatch):
    """``Engine(kv_bits=)``: the fused blocks write each row's keys and values into the pool's
    codes, scales and biases (``pool_write``, each row quantized as mx.quantize does) and read
    them packed (``paged_attention_output``): each row's tokens and log-probs those of MLX's own
    path, the single-request loop over a ``QuantizedKVCache`` (1e-4 relative), every block fused, the
    pool written in place; the same for that loop itself on the kernels (``--kv-bits``: the
    cache's buffers written and read the same way); pool_write's codes, scales and biases
    mx.quantize's bit for bit, and arrays held elsewhere copied, not written in place."""
    from mlxinfer.cache.prompt import PromptCache

    path, _ = make_tiny(tmp_path / "hf", perturb_vectors=True, head_dim=64)
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=4, group_size=32, dtype="float32")
    prompts = [[(3 + 17 * i + 5 * n) % 256 for i in range(n)] for n in (5, 40, 19)]
    monkeypatch.setenv(backends.ENV, "0")
    plain, _ = load_model(tmp_path / "q")
    monkeypatch.delenv(backends.ENV)
    expected = []
    for p in prompts:
        cache = PromptCache(plain.make_cache(kv_bits=bits))
        expected.append(list(generate_step(p, plain, prompt_cache=cache, max_tokens=6)))
    counter = Counting(K, ENGINE_CALLS)
    monkeypatch.setattr(kernels, "load", lambda: counter)
    model, _ = load_model(tmp_path / "q")
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    copies = K.attention_buffer_copies()
    with Engine(model, max_batch=4, block_size=16, kv_bits=bits) as engine:
        handles = [engine.submit(p, max_tokens=6) for p in prompts]
        got = [list(h.steps(timeout=60)) for h in handles]
    for want, rows in zip(expected, got):
        assert [t for t, _ in want] == [s.token for s in rows]
        for (_, x), s in zip(want, rows):
            # the products' int16 kernels against MLX's quantized matmul: float32 rounding
            np.testing.assert_allclose(np.array(x), np.array(s.logprobs), rtol=1e-4, atol=1e-4)
    assert K.attention_buffer_copies() == copies
    calls = counter.calls
    assert calls["pool_write"] == calls["paged_attention_output"]  # k and v's 3 parts: 1 call
    assert 5 * len(model.layers) <= calls["paged_attention_output"] <= 15 * len(model.layers)

    counter.calls = dict.fromkeys(ENGINE_CALLS, 0)  # generate --kv-bits: one row, its own cache
    for p, want in zip(prompts, expected):
        cache = PromptCache(model.make_cache(kv_bits=bits))
        ours = list(generate_step(p, model, prompt_cache=cache, max_tokens=6))
        assert [t for t, _ in want] == [t for t, _ in ours]
        for (_, x), (_, y) in zip(want, ours):
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-4, atol=1e-4)
    assert K.attention_buffer_copies() == copies  # the cache's buffers written in place
    # each prompt's one-token forwards, every layer fused: its last token (generate_step's
    # prompt ends in a one-token step) and 5 of the 6 tokens (the last is not fed)
    calls = counter.calls
    assert calls["paged_attention_output"] == 3 * 6 * len(model.layers)
    assert calls["pool_write"] == calls["paged_attention_output"]

    rng = np.random.default_rng(1)  # the write's quantization against mx.quantize
    qkv = mx.array(rng.standard_normal((3, 1, 7 * 64)).astype(np.float32))
    sides = [
        [mx.zeros(a.shape, a.dtype) for a in mx.quantize(mx.zeros((5, 2, 4, 64)), bits=bits)]
        for _ in range(2)
    ]
    rows = mx.array(np.array([3, 8, 17, 22, 30, 39], np.uint32))  # (block · 2 + head) · 4 + slot
    empty = mx.zeros((3, 0))
    written = K.pool_write(
        *sides, qkv, rows, empty, empty, k_start=5 * 64, v_start=3 * 64, group_size=64, bits=bits
    )
    for got, start in ((written[:3], 5 * 64), (written[3:], 3 * 64)):
        want = mx.quantize(qkv[:, 0, start : start + 128].reshape(6, 64), group_size=64, bits=bits)
        for got_part, want_part in zip(got, want):
            flat = np.array(got_part).reshape(40, -1)
            assert np.array_equal(flat[np.array(rows)], np.array(want_part))
            assert not np.delete(flat, np.array(rows), axis=0).any()
    # held elsewhere, the arrays are not written in place: a copy, the held ones unchanged
    copies = K.attention_buffer_copies()
    held = [mx.zeros(a.shape, a.dtype) for a in sides[0]]
    mx.eval(held)
    mx.eval(K.pool_write(held, list(sides[1]), qkv, rows, empty, empty, k_start=0, v_start=0,
                         group_size=64, bits=bits))  # fmt: skip
    assert not any(np.array(a).any() for a in held)
    assert K.attention_buffer_copies() == copies + 3 + 3  # sides[1] is still held too


def test_fuse_gives_a_blocks_outputs_as_one_node_and_writes_the_cache_in_place():
    """``K.fuse``: a block's four calls (the one-row cache's, ``pool_write`` into its buffers)
    as one primitive give the calls' outputs bit for bit; the buffers are written in place
    where nothing else holds them, copied (the held arrays unchanged) where something does;
    what it refuses."""
    rng = np.random.default_rng(3)

    def r(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    def q(n, k):
        return (*mx.quantize(r(n, k) * 0.2, group_size=32, bits=4), 32, 4)

    x, norm, cos, sin = r(1, 1, 64), r(64), r(1, 8), r(1, 8)
    qkv_layer, o, gate_up, down = q(128, 64), q(64, 64), q(256, 64), q(64, 128)
    rows = mx.array([h * 8 + 3 for h in range(2)], mx.uint32)  # slot 3 of 2 heads x 8

    def block(keys, values, attend=None):
        qkv = K.norm_products(x, norm, 1e-5, [qkv_layer])
        k, v = K.pool_write([keys], [values], qkv, rows, cos, sin, k_start=64, v_start=96, dims=16)
        h = K.attention_output(
            x,
            qkv,
            k if attend is None else attend,
            v,
            cos,
            sin,
            o,
            n_q=4,
            offset=3,
            scale=0.25,
            dims=16,
        )
        return [K.mlp_output(h, norm, 1e-5, [gate_up], down), k, v]

    cache = [rng.standard_normal((1, 2, 8, 16)).astype(np.float32) for _ in range(2)]
    want = [np.array(a) for a in block(*map(mx.array, cache))]
    copies = K.attention_buffer_copies()
    got = K.fuse(block(*map(mx.array, cache)))
    assert all(np.array_equal(np.array(a), b) for a, b in zip(got, want))
    assert K.attention_buffer_copies() == copies  # nothing else held them: written in place
    held = mx.array(cache[0])
    got = K.fuse(block(held, mx.array(cache[1])))
    assert all(np.array_equal(np.array(a), b) for a, b in zip(got, want))
    assert np.array_equal(np.array(held), cache[0])
    assert K.attention_buffer_copies() == copies + 1
    with pytest.raises(ValueError, match=r"fuse\] outputs: expected arrays made by the block"):
        K.fuse([x])
    with pytest.raises(ValueError, match=r"fuse\] outputs: expected each array a call updates"):
        K.fuse(block(held, mx.array(cache[1]), attend=held)[:1])  # reads k before the write
    y = x  # a fused node is an input of the next fuse, not taken in: 5 blocks of 4 calls each
    for _ in range(5):
        qkv = K.norm_products(y, norm, 1e-5, [qkv_layer])
        k, v = K.pool_write([mx.array(cache[0])], [mx.array(cache[1])], qkv, rows, cos, sin,
                            k_start=64, v_start=96, dims=16)  # fmt: skip
        a = K.attention_output(y, qkv, k, v, cos, sin, o, n_q=4, offset=3, scale=0.25, dims=16)
        y = K.fuse([K.mlp_output(a, norm, 1e-5, [gate_up], down), k, v])[0]
    mx.eval(y)
    h = x
    for _ in range(17):
        h = K.mlp_output(h, norm, 1e-5, [gate_up], down)
    with pytest.raises(ValueError, match=r"fuse\] outputs: expected the graph of at most 16"):
        K.fuse([h])


def test_a_write_queued_behind_a_running_one_still_updates_in_place():
    """The batching engine queues step n + 1 before step n has run (batch/ahead.py). MLX's CPU
    tasks hold what a several-output primitive wrote (its siblings) until they run, so step
    n + 1's ``pool_write`` found step n's pool not donatable and copied it, every layer every
    step (found in a 300-token run: 29 copies a step at one row). Now the write waits for the
    evaluation that is still running and takes the buffer over: the values those of the two
    writes in turn, no copy; two writes in one evaluation still finish (the wait is only for an
    earlier evaluation's)."""
    rng = np.random.default_rng(5)
    pool = [rng.standard_normal((4, 2, 8, 16)).astype(np.float32) for _ in range(2)]
    qkv = [mx.array(rng.standard_normal((2, 1, 128)).astype(np.float32)) for _ in range(2)]
    rows = [mx.array([1, 9, 20, 28], mx.uint32), mx.array([2, 10, 21, 29], mx.uint32)]
    cos = sin = mx.zeros((2, 8))
    kw = dict(k_start=64, v_start=96, dims=16)

    def write(keys, values, i, after=None):
        x = qkv[i] if after is None else qkv[i] + 0 * mx.sum(after)
        return K.pool_write([keys], [values], x, rows[i], cos, sin, **kw)

    k, v = write(*map(mx.array, pool), 0)
    want = [np.array(a) for a in write(k, v, 1)]
    big = mx.array(rng.standard_normal((768, 768)).astype(np.float32)) / 30
    slow = big
    for _ in range(12):  # step n's work, still running when step n + 1 is queued
        slow = slow @ big
    copies = K.attention_buffer_copies()
    k, v = write(*map(mx.array, pool), 0, after=slow)
    mx.async_eval(k, v)
    k2, v2 = write(k, v, 1)
    del k, v  # the engine's pool holds step n + 1's arrays only
    mx.async_eval(k2, v2)
    assert all(np.array_equal(np.array(a), b) for a, b in zip((k2, v2), want))
    assert K.attention_buffer_copies() == copies  # fails where step n's pool is copied
    k, v = write(*map(mx.array, pool), 0, after=slow)
    k2, v2 = write(k, v, 1)
    del k, v
    mx.async_eval(k2, v2)  # both writes in one evaluation: no wait on its own event
    assert all(np.array_equal(np.array(a), b) for a, b in zip((k2, v2), want))
