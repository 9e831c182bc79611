"""Decode's products by parts on two CPU streams, against one product (MLX's own layers, numpy)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxinfer.backends.cpu import parallel as cpu_parallel
from mlxinfer.backends.cpu.layers import swap_layers
from mlxinfer.backends.cpu.quantized import CPUQuantizedLinear
from mlxinfer.models.layers import GatedMLP

on_cpu = pytest.mark.skipif(
    mx.default_device().type != mx.DeviceType.cpu,
    reason="the CPU layers are used only on MLX's CPU backend",
)


@pytest.mark.parametrize("rows", [1, 4, 40])
def test_blocked_projection_equals_matmul(rows):
    rng = np.random.default_rng(2)
    vocab = 5 * cpu_parallel.HEAD_CHUNK + 17  # a ragged last block
    w = rng.standard_normal((vocab, 32)).astype(np.float32)
    x = rng.standard_normal((1, rows, 32)).astype(np.float32)
    head = nn.Embedding(vocab, 32)
    head.weight = mx.array(w)
    out = np.array(cpu_parallel.project(mx.array(x), head))
    assert out.shape == (1, rows, vocab)
    assert np.abs(out - x.astype(np.float64) @ w.T.astype(np.float64)).max() <= 1e-4


def loads(layers, width):
    """Weights per stream under the layers' plans, after checking each plan covers its rows once."""
    per_stream = [0, 0]
    for layer in layers:
        parts = cpu_parallel.decode_parts(layer)
        assert parts[0][1] == 0 and parts[-1][2] == layer["weight"].shape[0]
        assert all(a[2] == b[1] for a, b in zip(parts, parts[1:]))  # contiguous, no overlap
        for stream, start, stop in parts:
            per_stream[stream] += (stop - start) * width
    return per_stream


def test_equal_siblings_run_whole_side_by_side():
    gate, up = nn.Linear(576, 1536), nn.Linear(576, 1536)
    cpu_parallel.plan_siblings([gate, up], 576)
    assert {cpu_parallel.decode_parts(gate), cpu_parallel.decode_parts(up)} == {
        ((0, 0, 1536),),
        ((1, 0, 1536),),
    }


def test_siblings_run_whole_unless_balanced():
    # SmolLM2's q/k/v: q (332k weights) on one stream, k + v (221k) on the other; balanced, q is
    # cut so that each stream holds 276k.
    q, k, v = nn.Linear(576, 576), nn.Linear(576, 192), nn.Linear(576, 192)
    cpu_parallel.plan_siblings([q, k, v], 576)
    assert sorted(loads([q, k, v], 576)) == [2 * 192 * 576, 576 * 576]
    assert (
        cpu_parallel.decode_parts(k)[0][0]
        == cpu_parallel.decode_parts(v)[0][0]
        != cpu_parallel.decode_parts(q)[0][0]
    )
    for layer in (q, k, v):
        cpu_parallel.plan_of(layer).parts = cpu_parallel.plan_of(layer).balanced_parts
    assert loads([q, k, v], 576) == [480 * 576, 480 * 576]
    assert len(cpu_parallel.decode_parts(q)) == 2


def test_large_imbalance_cuts_one_layer_to_balance():
    # Three equal 1,024 × 1,024 layers (multi-head attention): whole, one stream gets two of them,
    # 1M weights more than the other; one layer is cut at 512 rows and both streams hold 1.5M.
    layers = [nn.Linear(1024, 1024) for _ in range(3)]
    cpu_parallel.plan_siblings(layers, 1024)
    for layer in layers:
        cpu_parallel.plan_of(layer).parts = cpu_parallel.plan_of(layer).balanced_parts
    assert loads(layers, 1024) == [1536 * 1024, 1536 * 1024]
    assert sorted(len(cpu_parallel.decode_parts(layer)) for layer in layers) == [1, 1, 2]


def quantized(dim_in, dim_out, key, bias=False):
    layer = nn.QuantizedLinear.from_linear(nn.Linear(dim_in, dim_out, bias=bias), 64, 4)
    if bias:
        layer.bias = mx.random.normal((dim_out,), key=mx.random.key(key))
    return layer


@on_cpu
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shapes", [[(128, 96), (128, 32), (128, 32)], [(256, 256)] * 3])
def test_quantized_siblings_by_parts_equal_mlx_layers(rows, shapes, monkeypatch):
    """Whole side by side, and (three 256 × 256 layers, 65k weights over on one stream) cut to balance."""
    layers = [quantized(i, o, key=n, bias=n == 1) for n, (i, o) in enumerate(shapes)]
    x = mx.random.normal((1, rows, shapes[0][0]), key=mx.random.key(9))
    refs = [nn.QuantizedLinear.__call__(layer, x) for layer in layers]  # MLX's one kernel each
    for layer in layers:
        layer.__class__ = CPUQuantizedLinear
    cpu_parallel.plan_siblings(layers, shapes[0][0])
    for layer in layers:  # the balanced plan: cut where the streams are uneven
        cpu_parallel.plan_of(layer).parts = cpu_parallel.plan_of(layer).balanced_parts
    assert any(len(cpu_parallel.decode_parts(layer)) == 2 for layer in layers)
    for layer, ref in zip(layers, refs):
        assert mx.array_equal(layer(x), ref)  # the same kernel on the same rows: bit for bit


@on_cpu
def test_swap_layers_plans_quantized_siblings_only():
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 32)
    mlp = GatedMLP(64, 4096, nn.silu)  # 262k weights each
    nn.quantize(mlp, group_size=64, bits=4)
    # 3 quantized layers, the MLP, the float q/k/v stacked into one product and the quantized
    # gate/up into another (fused.py), and those 3 small float Linears as PaddedLinear (few-row
    # products may run padded)
    assert swap_layers(nn.Sequential(attn, mlp)) == 9
    assert all(
        getattr(getattr(attn, n), "cpu_plan", None) is None for n in ("q_proj", "k_proj", "v_proj")
    )  # float: no stream plan
    assert {cpu_parallel.decode_parts(mlp.gate_proj), cpu_parallel.decode_parts(mlp.up_proj)} == {
        ((0, 0, 4096),),
        ((1, 0, 4096),),
    }
    assert cpu_parallel.plan_of(mlp.down_proj).parts is None  # no siblings: cut in halves
    assert cpu_parallel.decode_parts(mlp.down_proj) == ((0, 0, 32), (1, 32, 64))


@on_cpu
def test_quantized_product_equals_one_kernel():
    layer = quantized(128, 384, key=5, bias=True)
    ref = nn.QuantizedLinear.__call__(
        layer, x := mx.random.normal((1, 3, 128), key=mx.random.key(5))
    )
    layer.__class__ = CPUQuantizedLinear  # three rows: the two-thread decode path, in halves
    assert cpu_parallel.decode_parts(layer) == ((0, 0, 192), (1, 192, 384))
    assert mx.array_equal(layer(x), ref)


@on_cpu
def test_siblings_in_a_non_affine_mode_are_planned_and_exact():
    mlp = GatedMLP(64, 256, nn.silu)
    nn.quantize(mlp, group_size=32, bits=4, mode="mxfp4")  # no biases: scales only
    x = mx.random.normal((1, 1, 64), key=mx.random.key(11))
    refs = [nn.QuantizedLinear.__call__(layer, x) for layer in (mlp.gate_proj, mlp.up_proj)]
    swap_layers(mlp)
    assert {cpu_parallel.decode_parts(mlp.gate_proj), cpu_parallel.decode_parts(mlp.up_proj)} == {
        ((0, 0, 256),),
        ((1, 0, 256),),
    }
    for layer, ref in zip((mlp.gate_proj, mlp.up_proj), refs):
        assert mx.array_equal(layer(x), ref)


def gated_mlp_float64(mlp, x):
    """down(silu(gate x) · up x) in float64 numpy, from the layers' weights before any CPU switch."""
    w = {
        name: np.array(getattr(mlp, name).weight, dtype=np.float64)
        for name in cpu_parallel.GATED_MLP
    }
    b = {
        name: (
            np.array(getattr(mlp, name).bias, dtype=np.float64)
            if "bias" in getattr(mlp, name)
            else 0.0
        )
        for name in cpu_parallel.GATED_MLP
    }
    x = np.array(x, dtype=np.float64)
    g, u = x @ w["gate_proj"].T + b["gate_proj"], x @ w["up_proj"].T + b["up_proj"]
    return (g / (1 + np.exp(-g)) * u) @ w["down_proj"].T + b["down_proj"]


@on_cpu
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_float_gated_mlp_in_halves_equals_float64(rows, bias, monkeypatch):
    """Few rows: two half MLPs on the two streams, summed; many rows (prefill): the transposed down
    projection in one product. Both against the float64 definition."""
    monkeypatch.setattr(cpu_parallel.CPULinear, "MIN_SIZE", 1 << 12)
    mlp = GatedMLP(
        64, 200, nn.silu, bias=bias
    )  # 12.8k weights per layer; 100 hidden units per half
    if bias:
        for name in cpu_parallel.GATED_MLP:
            getattr(mlp, name).bias = mx.random.normal(
                getattr(mlp, name).bias.shape, key=mx.random.key(3)
            )
    x = mx.random.normal((1, rows, 64), key=mx.random.key(4))
    ref = gated_mlp_float64(mlp, x)
    swap_layers(mlp)
    assert isinstance(mlp.down_proj, cpu_parallel.TransposedLinear)
    assert mlp.down_proj.weight_t.shape == (200, 64) and "weight" not in mlp.down_proj
    assert cpu_parallel.runs_in_halves(x, mlp.down_proj) == (
        rows <= cpu_parallel.CPULinear.MAX_ROWS
    )
    assert np.abs(np.array(mlp(x)) - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


@on_cpu
def test_small_or_quantized_gated_mlps_keep_their_down_projection():
    small = GatedMLP(64, 200, nn.silu)  # 12.8k weights: below CPULinear.MIN_SIZE
    quantized_mlp = GatedMLP(64, 8192, nn.silu)
    nn.quantize(quantized_mlp, group_size=64, bits=4)
    swap_layers(nn.Sequential(small, quantized_mlp))
    assert type(small.down_proj) is cpu_parallel.PaddedLinear  # not held transposed
    assert type(quantized_mlp.down_proj) is CPUQuantizedLinear


def test_fused_siblings_equal_their_own_products_in_any_call_order():
    """q/k/v stacked into one product: each sibling's columns equal its own product, also when
    calls interleave (another thread's input in between: the product is recomputed)."""
    from mlxinfer.backends.cpu import fused
    from mlxinfer.backends.cpu.layers import with_mixin

    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (nn.Linear(64, n, bias=True) for n in (64, 32, 32))
    refs = {name: (attn[name].weight, attn[name].bias) for name in ("q_proj", "k_proj", "v_proj")}
    assert fused.fuse_siblings(attn, with_mixin) == 1
    x1, x2 = (mx.random.normal((1, 3, 64), key=mx.random.key(k)) for k in (1, 2))

    def own(name, x):
        w, b = refs[name]
        return x @ w.T + b

    got = [(attn.q_proj(x1), "q_proj", x1), (attn.q_proj(x2), "q_proj", x2)]
    got += [(attn.k_proj(x1), "k_proj", x1), (attn.v_proj(x1), "v_proj", x1)]
    for out, name, x in got:
        assert np.abs(np.array(out) - np.array(own(name, x))).max() <= 1e-5, name
    assert attn.k_proj.weight.shape == (32, 64) and "weight" in attn.k_proj.parameters()
    attn.q_proj.cpu_fused[0].on = False  # the plan off: each its own product again
    assert mx.array_equal(attn.v_proj(x2), nn.Linear.__call__(attn.v_proj, x2))


@on_cpu
@pytest.mark.parametrize("bias", [False, True])
def test_fused_quantized_siblings_equal_their_own_kernel_products(bias):
    """Quantized q/k/v of one format stacked (codes, scales, biases, bias by rows): with the
    kernel plan, each sibling's rows of the one stacked kernel call equal its own kernel product
    exactly, in any call order; siblings of different formats stay apart."""
    from mlxinfer.backends import kernels
    from mlxinfer.backends.cpu import compiled, fused
    from mlxinfer.backends.cpu.layers import with_mixin

    if kernels.load() is None:
        pytest.skip("the compiled kernels are not built (python tools/build_kernels.py)")
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (
        quantized(128, n, key=n, bias=bias) for n in (128, 64, 64)
    )
    for name in ("q_proj", "k_proj", "v_proj"):
        attn[name].__class__ = CPUQuantizedLinear
    own = {name: compiled.quantized_call(kernels.load(), attn[name]) for name in attn}
    x1, x2 = (mx.random.normal((1, 3, 128), key=mx.random.key(k)) for k in (1, 2))
    want = {(name, i): own[name](x, attn[name]) for name in own for i, x in enumerate((x1, x2))}
    mx.eval(list(want.values()))
    assert fused.fuse_quantized_siblings(attn, with_mixin, CPUQuantizedLinear) == 1
    for name in own:
        cpu_parallel.plan_of(attn[name]).kernel = True
        compiled.bind(attn[name])
    got = [("q_proj", 0, attn.q_proj(x1)), ("q_proj", 1, attn.q_proj(x2))]
    got += [("k_proj", 0, attn.k_proj(x1)), ("v_proj", 0, attn.v_proj(x1))]
    got += [("v_proj", 1, attn.v_proj(x2))]
    for name, i, out in got:
        assert mx.array_equal(out, want[name, i]), (name, i)
    assert attn.k_proj["weight"].shape == (64, 128 * 4 // 32)  # a view of the stacked codes

    mixed = nn.Module()
    mixed.q_proj, mixed.k_proj = quantized(128, 64, key=1), quantized(128, 64, key=2)
    mixed.v_proj = nn.QuantizedLinear.from_linear(nn.Linear(128, 64), group_size=64, bits=8)
    for name in ("q_proj", "k_proj", "v_proj"):
        mixed[name].__class__ = CPUQuantizedLinear
    assert fused.fuse_quantized_siblings(mixed, with_mixin, CPUQuantizedLinear) == 0


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_float_mlp_sliced_in_a_stepwise_prefill_equals_float64(transposed, bias, monkeypatch):
    """A float prefill chunk through the MLP slice by slice of hidden units (down held as is or
    transposed), against the float64 definition."""
    from mlxinfer.backends.cpu import quantized

    if transposed:
        monkeypatch.setattr(cpu_parallel.CPULinear, "MIN_SIZE", 1 << 12)
    mlp = GatedMLP(64, quantized.MLP_SLICE + 200, nn.silu, bias=bias)  # a full slice, a partial one
    if bias:
        for name in cpu_parallel.GATED_MLP:
            layer = getattr(mlp, name)
            layer.bias = mx.random.normal(layer.bias.shape, key=mx.random.key(7))
    x = mx.random.normal((1, quantized.MLP_SLICE_ROWS, 64), key=mx.random.key(8))
    ref = gated_mlp_float64(mlp, x)
    swap_layers(mlp)
    assert isinstance(mlp.down_proj, cpu_parallel.TransposedLinear) == transposed
    calls = []
    sliced = quantized.sliced_mlp
    monkeypatch.setattr(quantized, "sliced_mlp", lambda *a: calls.append(1) or sliced(*a))
    with quantized.stepwise_prefill(mlp, floats=True):
        out = mlp(x)
    assert calls == [1]
    assert np.abs(np.array(out) - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
