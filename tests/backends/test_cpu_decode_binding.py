"""The CPU backend's per-layer decisions, cached when a plan is set (issue 47, "Python off the
hot path"): a quantized layer's kernel call (``compiled.bind``) and the ``decode`` plan's norm
and SwiGLU kernels (``compiled.decode_kernels``) are decided by ``kinds.set_plan``, not per
call. Setting another plan after load refreshes them: the kernels are called exactly where the
plan now says so, and the outputs are bit-identical to the undecided path and to before the
switch. Every test forces its plans: no outcome depends on timing."""

import mlx.core as mx
import numpy as np
import pytest
from hf_models import add_tokenizer, make_tiny

from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import compiled, kinds
from mlxinfer.backends.cpu import plans as cpu_plans
from mlxinfer.backends.cpu.quantized import CPUQuantizedLinear
from mlxinfer.generation import generate_step
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model
from mlxinfer.models.layers import GatedMLP, RMSNorm

K = kernels.load()
pytestmark = [
    pytest.mark.skipif(K is None, reason=f"compiled kernels absent: {kernels.reason()}"),
    pytest.mark.skipif(
        mx.default_device().type != mx.DeviceType.cpu, reason="the CPU backend's kernels"
    ),
]

VOCAB = 512
IDS = [(5 + 37 * i) % VOCAB for i in range(10)]


class Counting:
    """The kernels' module, counting the quantized products (every other attribute its own)."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def __getattr__(self, name):
        return getattr(self.module, name)

    def quantized_matvec(self, *a, **k):
        self.calls += 1
        return self.module.quantized_matvec(*a, **k)


@pytest.fixture(scope="module")
def quantized_path(tmp_path_factory):
    where = tmp_path_factory.mktemp("bind")
    path, _ = make_tiny(where / "hf", vocab_size=VOCAB, num_hidden_layers=2)
    add_tokenizer(path)
    convert(path, where / "q", quantize=True, bits=4, group_size=64, dtype="float32")
    return where / "q"


def decode_logits(model) -> np.ndarray:
    """One token a step through the cache: the decode path, (len(IDS), vocab)."""
    cache = model.make_cache()
    return np.stack([np.array(model(mx.array([[t]]), cache)[0, -1]) for t in IDS])


def greedy(model) -> list[int]:
    return [t for t, _ in generate_step(IDS[:4], model, max_tokens=8, prefill_step_size=2)]


def test_a_plan_set_after_load_refreshes_the_cached_kernel_decision(quantized_path, monkeypatch):
    counter = Counting(K)
    monkeypatch.setattr(kernels, "load", lambda: counter)
    model, _ = load_model(quantized_path)
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    layers = [m for m in model.modules() if isinstance(m, CPUQuantizedLinear)]
    assert layers and all(m.cpu_kernel is not None for m in layers)
    on, on_tokens = decode_logits(model), greedy(model)
    assert counter.calls > 0

    kinds.set_plan(model, "quantized", "one")  # after load: the decision follows the plan
    assert all(m.cpu_kernel is None for m in layers)
    counter.calls = 0
    off = decode_logits(model)
    assert counter.calls == 0  # MLX's quantized_matmul: the kernel never called
    assert np.abs(off - on).max() <= 1e-4 * np.abs(on).max()

    kinds.set_plan(model, "quantized", "kernel")  # and back: bound again, the same bits
    assert all(m.cpu_kernel is not None for m in layers)
    assert np.array_equal(decode_logits(model), on)
    assert greedy(model) == on_tokens
    assert counter.calls > 0

    # The undecided path (no cached call: compiled.runs and quantized_product per call) gives
    # the same bits as the cached one.
    for m in layers:
        object.__setattr__(m, "cpu_kernel", None)
    assert np.array_equal(decode_logits(model), on)
    K.set_num_threads(0)


def test_the_decode_plan_binds_its_kernels_when_set(quantized_path):
    model, _ = load_model(quantized_path)
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert all(m.cpu_rms_norm is not None for m in norms)
    assert all(m.cpu_swiglu is not None for m in mlps)
    on = decode_logits(model)

    kinds.set_plan(model, "decode", "ops")
    assert all(m.cpu_rms_norm is None for m in norms)
    assert all(m.cpu_swiglu is None for m in mlps)
    ops = decode_logits(model)
    assert np.abs(ops - on).max() <= 1e-4 * np.abs(on).max()

    kinds.set_plan(model, "decode", "kernel")
    assert np.array_equal(decode_logits(model), on)
    assert compiled.decode_kernels(False) == (None, None)
    K.set_num_threads(0)


def test_the_blocks_child_modules_are_bound_and_follow_replacement(quantized_path):
    """``layers.bind_children``: a block's child modules are plain attributes (no
    ``nn.Module.__getattr__`` per read), the same objects as in its dict, and a child set or
    deleted after load, by any route, is what the attribute then gives; the outputs are those
    of the unbound modules, bit for bit."""
    import mlx.nn as nn

    from mlxinfer.backends.cpu.layers import CPUBoundChildren

    model, _ = load_model(quantized_path)
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    block = model.layers[0]
    assert isinstance(block, CPUBoundChildren) and not isinstance(model, CPUBoundChildren)
    assert block.__dict__["mlp"] is block["mlp"] and block.self_attn is block["self_attn"]
    bound = decode_logits(model)
    for _, m in model.named_modules():  # unbound: every read through __getattr__ again
        if isinstance(m, CPUBoundChildren):
            for k in [k for k, v in m.__dict__.items() if isinstance(v, nn.Module)]:
                del m.__dict__[k]
    assert np.array_equal(decode_logits(model), bound)

    mlp = block["mlp"]
    block.mlp = nn.Identity()  # nn.Module.__setattr__ -> __setitem__
    assert isinstance(block.mlp, nn.Identity) and isinstance(block["mlp"], nn.Identity)
    block["mlp"] = mlp
    assert block.mlp is mlp
    block.update_modules({"mlp": nn.Identity()})
    assert isinstance(block.mlp, nn.Identity)
    del block.mlp
    assert "mlp" not in block and "mlp" not in block.__dict__
    K.set_num_threads(0)


def test_decode_attention_grows_the_cache_when_full(quantized_path, monkeypatch):
    """``attention_kernels.decode_attention`` calls ``make_room`` only when the buffers are full: with
    4-token growth, 10 one-token steps cross three growths and give the logits of the ops
    path, which grows the same buffers through ``update_and_fetch``."""
    from mlxinfer.cache.kv import KVCache

    monkeypatch.setattr(KVCache, "step", 4)
    model, _ = load_model(quantized_path)
    cpu_plans.set_plans(model, cpu_plans.forced_plans("kernels"))
    on = decode_logits(model)
    kinds.set_plan(model, "decode", "ops")
    ops = decode_logits(model)
    assert np.abs(ops - on).max() <= 1e-4 * np.abs(on).max()
    kinds.set_plan(model, "decode", "kernel")
    cache = model.make_cache()
    for t in IDS:
        model(mx.array([[t]]), cache)
    assert cache[0].offset == len(IDS) and cache[0].keys.shape[2] == 12
    K.set_num_threads(0)
