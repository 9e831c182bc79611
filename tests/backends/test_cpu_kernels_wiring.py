"""The compiled kernels in the CPU backend (backends/cpu/compiled.py; issue 32, "Wiring"):
with the ``kernel`` plans forced on, float models match transformers (logits within 1e-3,
greedy tokens) and 4-, 3-, 6-bit, mxfp4, nvfp4 and mxfp8 models match MLX's own quantized path,
tied and untied heads;
the kernels are called exactly where a product has at most 16 rows (a quantized layer's:
fewer than its ``dequantize_rows``) and the plan says so, never otherwise; the plan timing keeps a kernel only where it wins, and the thread count is
a plan too. Every test forces the plans it checks: no outcome depends on timing."""

import contextlib
import inspect
import io
import json

import mlx.core as mx
import numpy as np
import pytest
from hf_models import add_tokenizer, make_tiny, torch_greedy, torch_logits

from mlxinfer import backends
from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import compiled, kinds, parallel, timing
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
]

VOCAB = 4096  # > 2 x parallel.HEAD_CHUNK rows: the float head is a plan of its own ("head")
SHAPES = dict(vocab_size=VOCAB, num_hidden_layers=2)
IDS = [(5 + 37 * i) % VOCAB for i in range(24)]
LAYERS = SHAPES["num_hidden_layers"]


class Counting:
    """The kernels' module, counting the product calls (every other attribute its own)."""

    def __init__(self, module):
        self.module, self.calls = module, {"matvec": 0, "quantized_matvec": 0, "dequantize": 0}

    def __getattr__(self, name):
        return getattr(self.module, name)

    def matvec(self, *a, **k):
        self.calls["matvec"] += 1
        return self.module.matvec(*a, **k)

    def quantized_matvec(self, *a, **k):
        self.calls["quantized_matvec"] += 1
        return self.module.quantized_matvec(*a, **k)

    def dequantize(self, *a, **k):
        self.calls["dequantize"] += 1
        return self.module.dequantize(*a, **k)

    def take(self) -> dict:
        calls, self.calls = self.calls, {k: 0 for k in self.calls}
        return calls


@pytest.fixture
def counting(monkeypatch):
    counter = Counting(K)
    monkeypatch.setattr(kernels, "load", lambda: counter)
    yield counter
    K.set_num_threads(0)  # the pool is the process's: back to every usable CPU


@pytest.fixture(autouse=True)
def small_layers_split(monkeypatch):
    # The tiny models' float Linears count as large: CPULinear, and each gated MLP held in halves
    # (its down projection transposed), so every float layer class the kernel acts on is here.
    monkeypatch.setattr(parallel.CPULinear, "MIN_SIZE", 1 << 12)


SPECS = {
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "qwen2-untied": dict(model_type="qwen2", tie_word_embeddings=False),  # biases, a Linear head
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (path, transformers model), each made once."""
    made = {}

    def get(name):
        if name not in made:
            where = tmp_path_factory.mktemp(name) / "m"
            made[name] = make_tiny(where, perturb_vectors=True, **SHAPES, **SPECS[name])
        return made[name]

    return get


def forced(model, value):
    cpu_plans.set_plans(model, cpu_plans.forced_plans(value))


def logits(model, ids, chunk):
    """Logits of ``ids`` fed ``chunk`` tokens at a time through the cache, (len(ids), vocab)."""
    cache = model.make_cache()
    parts = [model(mx.array([ids[i : i + chunk]]), cache)[0] for i in range(0, len(ids), chunk)]
    return np.array(mx.concatenate(parts).astype(mx.float32))  # bf16: numpy has no such type


@pytest.mark.parametrize("name", sorted(SPECS))
def test_float_models_match_transformers_with_the_kernels_on_and_off(name, tiny, counting):
    path, torch_model = tiny(name)
    model, _ = load_model(path)
    ref = torch_logits(torch_model, IDS)
    greedy = torch_greedy(torch_model, IDS[:6], 12)
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, parallel.TransposedLinear)
    for value in ("kernels", "off", "kernels"):  # switched both ways on one model
        forced(model, value)
        on = value == "kernels"
        assert ("weight" in down) == on  # the kernel reads (out, in), the halves (in, out)
        counting.take()
        # 12-token chunks (<= 16 rows: the kernel), then 24 at once (prefill: never the kernel)
        assert np.abs(logits(model, IDS, 12) - ref).max() <= 1e-3, value
        # per block: q/k/v stacked, o, gate/up stacked, down; and the LM head
        assert counting.take() == {
            "matvec": 2 * (4 * LAYERS + 1) * on,
            "quantized_matvec": 0,
            "dequantize": 0,
        }
        assert np.abs(logits(model, IDS, 24) - ref).max() <= 1e-3, value
        assert counting.take()["matvec"] == 0
        ours = [t for t, _ in generate_step(IDS[:6], model, max_tokens=12, prefill_step_size=4)]
        assert ours == greedy, value


def test_a_bfloat16_model_takes_the_kernel_and_matches(tiny, counting):
    """Loaded in bfloat16 (``dtype``; the CPU default is float32), the float layers and the head
    are the kernel's too (bf16 weights, f32 accumulation): the same calls as in float32, logits
    within bf16's rounding of transformers' float32 ones and of MLX's own bf16 products (the
    kernels off), the same greedy tokens as with them off."""
    path, torch_model = tiny("llama-tied")
    model, _ = load_model(path, dtype=mx.bfloat16)
    assert model.layers[0].mlp.gate_proj.weight.dtype == mx.bfloat16
    found = cpu_plans.plan_layers(model)
    assert found["matvec"] and "kernel" in kinds.options_of(model, "head", found)
    ref = torch_logits(torch_model, IDS)
    outs, tokens = {}, {}
    for value in ("kernels", "off"):
        forced(model, value)
        counting.take()
        outs[value] = logits(model, IDS, 12)
        on = value == "kernels"
        assert counting.take() == {
            "matvec": 2 * (4 * LAYERS + 1) * on,
            "quantized_matvec": 0,
            "dequantize": 0,
        }
        ours = generate_step(IDS[:6], model, max_tokens=12, prefill_step_size=4)
        tokens[value] = [t for t, _ in ours]
    top = np.abs(ref).max()
    # bf16 weights and activations against f32 (observed 1.4% of the largest logit)
    assert np.abs(outs["kernels"] - ref).max() <= 0.05 * top
    # against MLX's bf16 products: a few bf16 roundings (observed 0.03%)
    assert np.abs(outs["kernels"] - outs["off"]).max() <= 2.0**-6 * top
    assert tokens["kernels"] == tokens["off"]


FLOAT_MODES = ("mxfp4", "nvfp4", "mxfp8")


def mlx_lm_float_mode(path, out, mode):
    """mlx-lm's own conversion of the model at ``path`` to MLX's float ``mode`` (float32
    elsewhere)."""
    mlx_lm = pytest.importorskip("mlx_lm", reason=f"mlx-lm (writes the {mode} test model)")
    if "q_mode" not in inspect.signature(mlx_lm.convert).parameters:
        pytest.skip(f"mlx-lm {mlx_lm.__version__} has no q_mode (MLX's float modes)")
    config = json.loads((path / "config.json").read_text())  # mlx-lm reads the top-level theta
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta", 1e4))
    (path / "config.json").write_text(json.dumps(config))
    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm.convert(str(path), str(out), quantize=True, q_mode=mode, dtype="float32")


@pytest.mark.parametrize(
    "tied,bits",
    [
        (True, 4),
        (False, 4),
        (False, 3),
        (True, 6),
        (True, "mxfp4"),
        (True, "nvfp4"),
        (False, "mxfp8"),
    ],
    ids=[
        "4bit-tied",
        "4bit-untied",
        "3bit-untied",
        "6bit-tied",
        "mxfp4-tied",
        "nvfp4-tied",
        "mxfp8-untied",
    ],
)
def test_a_quantized_model_matches_mlx_quantized_path_with_the_kernels(
    tied, bits, tmp_path, monkeypatch
):
    """4-bit, the bit-stream widths whose codes straddle words (3, 6) and MLX's float modes
    (mlx-lm's conversions, no biases: mxfp4's E2M1 codes with E8M0 scales per 32, nvfp4's with
    E4M3 scales per 16, mxfp8's E4M3 codes with E8M0 scales): every quantized product of fewer
    rows than ``dequantize_rows`` a kernel call (q/k/v and gate/up one stacked call each: the
    ``fuse`` plan), within its bound of MLX's quantized_matmul."""
    path, _ = make_tiny(tmp_path / "hf", tie_word_embeddings=tied, **SHAPES)
    add_tokenizer(path)
    if bits in FLOAT_MODES:
        mlx_lm_float_mode(path, tmp_path / "q", bits)
    else:
        convert(path, tmp_path / "q", quantize=True, bits=bits, group_size=64, dtype="float32")
    monkeypatch.setenv(backends.ENV, "0")  # MLX's own layers and quantized_matmul
    plain, _ = load_model(tmp_path / "q")
    monkeypatch.delenv(backends.ENV)
    ref_short, ref_long = logits(plain, IDS, 12), logits(plain, IDS, 24)
    ref_greedy = [t for t, _ in generate_step(IDS[:6], plain, max_tokens=12, prefill_step_size=4)]
    counter = Counting(K)
    monkeypatch.setattr(kernels, "load", lambda: counter)
    model, _ = load_model(tmp_path / "q")
    down = model.layers[0].mlp.down_proj
    assert model.backend == "cpu" and (down.mode if bits in FLOAT_MODES else down.bits) == bits
    for value in ("kernels", "off"):
        forced(model, value)
        on = value == "kernels"
        counter.take()
        # 12-row products: within the kernels' bound against MLX's (1e-4 of the largest)
        assert np.abs(logits(model, IDS, 12) - ref_short).max() <= 1e-4 * np.abs(ref_short).max()
        # per block q/k/v as one stacked product (fused), o, gate/up as one, down; and the head
        # (the quantized embedding, if tied)
        assert counter.take() == {
            "matvec": 0,
            "quantized_matvec": 2 * (4 * LAYERS + 1) * on,
            "dequantize": 0,
        }
        # 24 rows, below dequantize_rows (32 here): the kernel too, once per block product and
        # an untied head's (MLX's quantized_matmul there, a scalar loop, made a 24-token chunk of
        # SmolLM2 ~20x slower than 16 rows); a tied head dequantizes past 16 rows (head_rows)
        assert np.abs(logits(model, IDS, 24) - ref_long).max() <= 1e-3
        assert counter.take()["quantized_matvec"] == (4 * LAYERS + (not tied)) * on
        kinds.set_plan(model, "dequantize_rows", 24)  # from 24 rows: dequantized for the BLAS
        assert np.abs(logits(model, IDS, 24) - ref_long).max() <= 1e-3  # prefill: dequantized
        # ... by the kernel (any plan) for affine weights, every block product and the head once
        affine = bits not in FLOAT_MODES
        assert counter.take() == {
            "matvec": 0,
            "quantized_matvec": 0,
            "dequantize": (7 * LAYERS + 1) * affine,
        }
        ours = [t for t, _ in generate_step(IDS[:6], model, max_tokens=12, prefill_step_size=4)]
        assert ours == ref_greedy, value
    K.set_num_threads(0)


def test_batched_decode_of_up_to_16_rows_takes_the_kernel_more_does_not(tiny, counting):
    path, torch_model = tiny("llama-tied")
    model, _ = load_model(path)
    forced(model, "kernels")
    for batch in (3, 16, 17):
        tokens = [[IDS[b % len(IDS)]] for b in range(batch)]  # one token per row: 1-token prompts
        out = np.array(model(mx.array(tokens))[:, -1])
        ref = np.stack([torch_logits(torch_model, t)[-1] for t in tokens])
        assert np.abs(out - ref).max() <= 1e-3, batch
        assert counting.take()["matvec"] == (4 * LAYERS + 1) * (batch <= 16), batch


def test_without_the_kernels_nothing_changes(tiny, monkeypatch):
    """No module (not built, MLXINFER_KERNELS=0): no kernel option or kind is offered, and
    forcing them runs MLX's ops."""
    path, torch_model = tiny("llama-tied")
    monkeypatch.setattr(kernels, "load", lambda: None)
    model, _ = load_model(path)
    found = cpu_plans.plan_layers(model)
    assert not found["matvec"] and not found["kernel_threads"]
    assert "kernel" not in kinds.options_of(model, "head", found)
    forced(model, "kernels")
    assert "weight_t" in model.layers[0].mlp.down_proj  # still held for the halves
    out = logits(model, IDS[:12], 12)
    assert np.abs(out - torch_logits(torch_model, IDS[:12])).max() <= 1e-3


def test_a_module_from_another_checkout_is_refused_at_load(monkeypatch):
    """A kernels module whose bindings' version is not the package's (left from an older
    checkout: its functions' arguments differ) is not used: load() gives None and reason()
    names the file, both versions and the rebuild, so decode runs MLX's ops instead of failing
    mid-step."""
    import types

    path = kernels._find()
    if path is None:
        pytest.skip(kernels.reason() or "kernels not built")
    for stale in (types.SimpleNamespace(), types.SimpleNamespace(api=kernels.API + 1)):
        monkeypatch.setattr(kernels, "_import", lambda p, stale=stale: stale)
        monkeypatch.setattr(kernels, "_loaded", None)
        assert kernels.load() is None
        found = getattr(stale, "api", 0)
        assert kernels.reason() == (
            f"kernels at {path} are another version's (bindings {found}, this mlxinfer calls "
            f"{kernels.API}): rebuild them (pip install -e . or python3 tools/build_kernels.py); "
            "MLX's own ops are used"
        )
    monkeypatch.undo()
    assert kernels.load() is not None and kernels.load().api == kernels.API  # this build's


def test_the_plan_timing_keeps_the_kernel_only_where_it_wins(tiny, counting, monkeypatch):
    """``measure`` on fake timings: a kernel that makes the blocks faster is kept, and its
    thread count is then timed (one thread faster: kept); a kernel that loses is refused and
    the thread count is not timed. The head's kernel loses in both."""
    model, _ = load_model(tiny("llama-tied")[0])
    found = cpu_plans.plan_layers(model)
    assert found["matvec"] and found["head"] and found["kernel_threads"]
    threads_set = []
    set_threads = compiled.set_threads
    monkeypatch.setattr(
        compiled, "set_threads", lambda option: threads_set.append(option) or set_threads(option)
    )

    def step_for(kernel_factor, block=0.004):
        class Step:
            scale, layers = 1.0, [None] * LAYERS

            def __init__(self, model, timed=None):
                self.timed = timed

            def blocks_seconds(self, steps=1):
                on = found["matvec"][0].cpu_plan.kernel
                one = K.num_threads() == 1
                return block * (kernel_factor * (0.9 if one else 1.0) if on else 1.0)

            def head_seconds(self, steps=1):
                return 0.001 if found["head"][0].cpu_plan.kernel else 0.0005

        return Step

    for name in ("long_keys", "small", "dequantized_attention", "pad_rows"):
        monkeypatch.setattr(timing, f"measure_{name}", lambda m: (4, {}))
    monkeypatch.setattr(timing, "DecodeStep", step_for(0.5))
    plans = timing.measure(model)["plans"]
    assert (plans["matvec"], plans["head"], plans["kernel_threads"]) == ("kernel", "one", "one")
    assert K.num_threads() == 1
    assert found["matvec"][0].cpu_plan.kernel and not found["head"][0].cpu_plan.kernel
    threads_set.clear()
    monkeypatch.setattr(timing, "DecodeStep", step_for(1.02))  # the kernel 2% slower
    plans = timing.measure(model)["plans"]
    assert (plans["matvec"], plans["kernel_threads"]) == ("blas", "all")
    assert "one" not in threads_set and not found["matvec"][0].cpu_plan.kernel
    assert "weight_t" in model.layers[0].mlp.down_proj  # held for the halves again
    # A step too slow to time every plan (4 s in all): the kernels alone, against the plainest.
    monkeypatch.setattr(timing, "DecodeStep", step_for(0.5, block=0.3))
    entry = timing.measure(model)
    assert (entry["plans"]["matvec"], entry["plans"]["kernel_threads"]) == ("kernel", "one")
    assert set(entry["seconds"]) == {"skipped", "head", "matvec", "kernel_threads", "decode"}
    assert entry["plans"]["decode"] == "ops"  # no faster here: the plainer option
    assert set(entry["seconds"]["matvec"]) == {"blas", "kernel"}
    assert "only the kernels timed" in cpu_plans.describe(entry)
    # ... and too slow for those (15 s): nothing timed, the plainest plans
    monkeypatch.setattr(timing, "DecodeStep", step_for(0.5, block=0.5))
    entry = timing.measure(model)
    assert (entry["plans"]["matvec"], entry["plans"]["kernel_threads"]) == ("blas", "all")
    assert "not timed" in cpu_plans.describe(entry)


def test_a_fuse_tie_keeps_stacked_siblings_where_the_kernels_run(tiny, counting, monkeypatch):
    """Where a kernel option was chosen, ``fuse`` is timed with ``fused`` (the static default)
    first: a tie keeps it, and ``separate`` must be 3 % faster to replace it."""
    model, _ = load_model(tiny("llama-tied")[0])
    found = cpu_plans.plan_layers(model)
    assert found["fuse"] and found["matvec"]

    def step_for(separate_factor):
        class Step:
            scale, layers = 1.0, [None] * LAYERS

            def __init__(self, model, timed=None):
                self.timed = timed

            def blocks_seconds(self, steps=1):
                t = 0.004 * (0.5 if found["matvec"][0].cpu_plan.kernel else 1.0)
                return t if found["fuse"][0].cpu_fused[0].on else t * separate_factor

            def head_seconds(self, steps=1):
                return 0.0005

        return Step

    for name in ("long_keys", "small", "dequantized_attention", "pad_rows"):
        monkeypatch.setattr(timing, f"measure_{name}", lambda m: (4, {}))
    for factor, expected in ((1.0, "fused"), (0.99, "fused"), (0.95, "separate")):
        monkeypatch.setattr(timing, "DecodeStep", step_for(factor))
        plans = timing.measure(model)["plans"]
        assert (plans["matvec"], plans["fuse"]) == ("kernel", expected), factor


def test_the_plans_name_the_kernels_and_the_cache_key_knows_them(tiny, monkeypatch):
    assert cpu_plans.forced_plans("quantized=kernel,matvec=kernel,kernel_threads=one") == {
        "quantized": "kernel",
        "matvec": "kernel",
        "kernel_threads": "one",
    }
    assert "kernel" not in cpu_plans.forced_plans("on").values()  # on: the two-stream plans
    assert "kernel" not in cpu_plans.forced_plans("off").values()
    every = cpu_plans.forced_plans("kernels")
    assert every["quantized"] == every["head"] == every["matvec"] == "kernel"
    model, _ = load_model(tiny("llama-tied")[0])
    key = cpu_plans.cache_key(model)
    monkeypatch.setattr(compiled, "key", lambda: ["avx2", 2, K.mlx_version])
    assert cpu_plans.cache_key(model) != key
