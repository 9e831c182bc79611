"""The CPU backend's decode plans: every option of every kind gives the same outputs
(transformers' for float, MLX's own quantized layers for 4-bit); the fastest option is kept,
measured once per machine and model, then cached (backends/cpu/plans.py, kinds.py, timing.py)."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from hf_models import add_tokenizer, make_tiny, torch_logits

from mlxinfer import backends
from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import choices, kinds, layers, timing
from mlxinfer.backends.cpu import plans as cpu_plans
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model
from mlxinfer.models.layers.attention import quantized_attention

pytestmark = pytest.mark.skipif(
    mx.default_device().type != mx.DeviceType.cpu,
    reason="the float plans exist on the CPU backend only",
)

# Big enough for every float plan: gate/up of 256 x 2,048 (512k weights: CPULinear cuts and MLP
# halves) and a 4,096-row tied head (the blocked LM head).
SHAPES = dict(
    hidden_size=256,
    intermediate_size=2048,
    vocab_size=4096,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def big_tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("plans") / "m", tie_word_embeddings=True, **SHAPES)


def options_of(model):
    """Every (kind, option) the model's layers can be switched to, the thresholds' extremes too."""
    found = cpu_plans.plan_layers(model)
    pairs = [
        (kind, option)
        for kind in cpu_plans.OPTIONS
        if found[kind]
        for option in cpu_plans.OPTIONS[kind]
    ]
    for kind in cpu_plans.numeric_kinds(model):  # always one form, and never
        pairs += [(kind, 1), (kind, cpu_plans.NEVER)]
    return pairs


def decode_logits(model, ids):
    cache = model.make_cache()
    prefill = np.array(model(mx.array([ids[:-1]]), cache)[0])
    return prefill, np.array(model(mx.array([ids[-1:]]), cache)[0, -1])  # one row: the plans' path


def test_every_float_plan_option_matches_transformers(big_tiny, monkeypatch):
    """Each option forced in turn: prefill and one-row decode logits within 1e-3 of transformers'."""
    path, torch_model = big_tiny
    monkeypatch.setenv(cpu_plans.ENV, "on")
    model, _ = load_model(path)
    found = cpu_plans.plan_layers(model)
    assert found["cut"] and found["halves"] and found["head"]  # every float plan is there to switch
    ids = [(5 + 37 * i) % SHAPES["vocab_size"] for i in range(12)]
    expected = torch_logits(torch_model, ids)
    for kind, option in options_of(model):
        cpu_plans.set_plans(model, cpu_plans.forced_plans("on"))  # the others at "on"
        cpu_plans.set_plan(model, kind, option)
        prefill, decode = decode_logits(model, ids)
        assert np.abs(prefill - expected[:-1]).max() <= 1e-3, (kind, option)
        assert np.abs(decode - expected[-1]).max() <= 1e-3, (kind, option)


def test_every_quantized_plan_option_matches_mlx_quantized_layers(big_tiny, tmp_path, monkeypatch):
    """4-bit: each option gives the logits of the plain MLX path (MLX's quantized kernels)."""
    path, _ = make_tiny(tmp_path / "hf", tie_word_embeddings=False, **SHAPES)
    add_tokenizer(path)
    convert(path, tmp_path / "q", quantize=True, bits=4, group_size=64, dtype="float32")
    ids = [(3 + 29 * i) % SHAPES["vocab_size"] for i in range(12)]
    monkeypatch.setenv(backends.ENV, "0")
    plain, _ = load_model(tmp_path / "q")
    ref_prefill, ref_decode = decode_logits(plain, ids)
    monkeypatch.delenv(backends.ENV)
    monkeypatch.setenv(cpu_plans.ENV, "on")
    model, _ = load_model(tmp_path / "q")
    assert model.backend == "cpu" and cpu_plans.plan_layers(model)["quantized"]
    assert "dequantize_rows" in cpu_plans.numeric_kinds(model)
    for kind, option in options_of(model):
        cpu_plans.set_plans(model, cpu_plans.forced_plans("on"))
        cpu_plans.set_plan(model, kind, option)
        prefill, decode = decode_logits(model, ids)
        if kind == "int16_rows":  # x rounded to int16 per block of 32, at 1 row decode too
            # (test_cpu_int16.py: about 1e-5 of a block's largest input per unit of weight)
            bound = 1e-3 * np.abs(ref_prefill).max(), 1e-3 * np.abs(ref_decode).max()
        else:
            bound = 1e-3, 1e-4
        assert np.abs(prefill - ref_prefill).max() <= bound[0], (kind, option)
        assert np.abs(decode - ref_decode).max() <= bound[1], (kind, option)


def test_attention_over_a_quantized_cache_is_the_same_in_either_form(big_tiny, monkeypatch):
    """``dequantized_attention`` forced both ways: each layer's 16-query chunk over its 8-bit KV
    cache gives what MLX's own quantized attention gives over that cache (its quantized matmul).

    The three are compared on the same queries and cache, captured from the model's forward pass,
    not through two models' logits: an 8-bit cache rounds each key and value to a step of its
    group's range / 255 (~0.025 here), so a value that two valid computations put ~2e-6 apart
    (another order of operations, another BLAS kernel) at half a step lands in neighbouring
    codes, and the logits then differ by up to 1.5e-3 whichever form attention takes (5 of 20
    prompts failed a 1e-4 bound on logits under OpenBLAS's Cooperlake kernels, 3 of 20 under
    its Haswell ones and under the reference BLAS: docs/blas.md)."""
    ids = [(11 + 31 * i) % SHAPES["vocab_size"] for i in range(24)]
    monkeypatch.setenv(cpu_plans.ENV, "off")
    model, _ = load_model(big_tiny[0])
    assert "dequantized_attention" in cpu_plans.numeric_kinds(model)
    attend = layers.CPUAttention.attend_keys
    calls = []

    def recording(self, q, k, v, *, scale, mask, cache, sinks=None):
        calls.append((self, q, k, v, scale, mask, cache))
        return attend(self, q, k, v, scale=scale, mask=mask, cache=cache, sinks=sinks)

    monkeypatch.setattr(layers.CPUAttention, "attend_keys", recording)
    cache = model.make_cache(kv_bits=8)
    model(mx.array([ids[:8]]), cache)
    calls.clear()
    mx.eval(model(mx.array([ids[8:]]), cache))
    assert len(calls) == SHAPES["num_hidden_layers"]
    for layer, q, k, v, scale, mask, kv in calls:
        assert kv.quantized and q.shape[2] == 16 and k[0].shape[2] == 24
        expected = quantized_attention(
            q, k, v, scale=scale, mask=mask, group_size=kv.group_size, bits=kv.bits
        )
        for threshold in (1, cpu_plans.NEVER):  # dequantized for 16 queries, and never
            cpu_plans.set_plan(model, "dequantized_attention", threshold)
            got = attend(layer, q, k, v, scale=scale, mask=mask, cache=kv)
            # float32 sums of 24 and 64 terms of values ~1 in another order: a few 1e-7 apart
            assert np.abs(np.array(got - expected)).max() <= 1e-5, threshold


def test_the_fastest_option_of_each_kind_is_kept(big_tiny, monkeypatch):
    """``measure`` keeps a plan only when it saves 3% of a decode step: the step estimated as the
    timed blocks scaled to all of them, plus the LM head timed alone. Without the compiled
    kernels (their options: tests/backends/test_cpu_kernels_wiring.py)."""
    monkeypatch.setattr(kernels, "load", lambda: None)
    model, _ = load_model(big_tiny[0])
    cost = {"cut": 0.5, "halves": 2.0}  # relative cost of the blocks with the plan on
    found = cpu_plans.plan_layers(model)

    class Step:  # three times as many blocks as timed
        scale, layers = 3.0, [None] * 6

        def __init__(self, model, timed=None):
            self.timed = timed

        def blocks_seconds(self, steps=1):
            total = 0.004
            for kind, factor in cost.items():
                if found[kind][0].cpu_plan.two_streams:
                    total *= factor
            if found["fuse"][0].cpu_fused[0].on:  # q/k/v and gate/up stacked: 10% faster
                total *= 0.9
            return total

        def head_seconds(self, steps=1):
            # The blocked head halves the head's time, which saves 2.4% of a step: not kept.
            return 0.0003 if found["head"][0].cpu_plan.two_streams else 0.0006

    monkeypatch.setattr(timing, "DecodeStep", Step)
    monkeypatch.setattr(timing, "measure_long_keys", lambda m: (4096, {}))
    monkeypatch.setattr(timing, "measure_small", lambda m: (1 << 14, {}))
    monkeypatch.setattr(timing, "measure_dequantized_attention", lambda m: (4, {}))
    monkeypatch.setattr(timing, "measure_pad_rows", lambda m: (6, {}))
    result = timing.measure(model)
    assert result["plans"] == {
        "cut": "two",
        "halves": "one",
        "head": "one",
        "fuse": "fused",
        "long_keys": 4096,
        "small": 1 << 14,
        "dequantized_attention": 4,
        "pad_rows": 6,
    }
    step = 3 * 0.004 + 0.0006  # blocks scaled to the whole step, plus the head
    assert result["seconds"]["cut"]["one"] == pytest.approx(step)
    assert result["seconds"]["halves"]["two"] == pytest.approx(3 * 0.004 * 0.5 * 2 + 0.0006)
    assert result["blocks_timed"] >= 2
    assert found["cut"][0].cpu_plan.two_streams and not found["halves"][0].cpu_plan.two_streams
    assert all(a.cpu_long_keys == 4096 for a in cpu_plans.attention_layers(model))
    assert all(m.cpu_small == 1 << 14 for m in cpu_plans.exponential_users(model))
    products = kinds.float_products(model)
    assert products[-1] is model.head and all(m.cpu_pad_rows == 6 for m in products)


def test_a_product_padded_to_16_rows_is_the_same_product():
    """``padded_product`` adds zero rows and cuts them off: the rows' values are the product's."""
    from mlxinfer.backends.cpu import ops

    w = mx.random.normal((96, 40))
    calls = []

    def product(z):
        calls.append(z.shape)
        return z @ w.T

    for rows in (1, 3, 8, 15, 16, 20):
        x = mx.random.normal((rows, 1, 40))
        y = ops.padded_product(x, product, pad_rows=3)
        assert y.shape == (rows, 1, 96)
        np.testing.assert_allclose(np.array(y), np.array(x @ w.T), atol=1e-5)
    assert [c[0] for c in calls] == [1, 16, 16, 16, 16, 20]  # 3 to 15 rows run as 16


def test_a_decode_step_by_parts_runs_the_models_own_blocks_and_head(big_tiny, monkeypatch):
    """``DecodeStep`` times the first blocks only and restores the model: afterwards a forward
    gives the same logits as before."""
    model, _ = load_model(big_tiny[0])
    ids = [(5 + 7 * i) % SHAPES["vocab_size"] for i in range(6)]
    before = decode_logits(model, ids)[1]
    step = timing.DecodeStep(model, timed=1)
    assert step.scale == SHAPES["num_hidden_layers"] and step.hidden.shape == (1, 1, 256)
    ran = []
    first = model.layers[0]
    monkeypatch.setattr(type(first), "__call__", lambda self, *a: ran.append(self) or a[0])
    step.blocks_seconds(2)
    assert ran == [first, first]  # one block per step, not both
    monkeypatch.undo()
    assert len(model.layers) == SHAPES["num_hidden_layers"]
    assert step.head_seconds() > 0
    assert np.abs(decode_logits(model, ids)[1] - before).max() == 0


def test_choice_is_measured_once_and_cached(big_tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_plans.ENV, raising=False)
    calls = []
    entry = {"plans": {"cut": "one", "halves": "one", "head": "two", "long_keys": 2048}, "steps": 2}
    monkeypatch.setattr(cpu_plans, "measure", lambda m, fixed=None: calls.append(fixed) or entry)
    monkeypatch.setattr(cpu_plans, "confirm", lambda m, result: result)  # its own test below
    monkeypatch.setattr(cpu_plans.quiet, "BUSY", 2.0)  # never busy here: its own test below
    logged = []
    model, _ = load_model(big_tiny[0], log=logged.append)
    assert calls == [None] and "CPU decode plans (timed here, once): cut=one" in logged[0]
    assert entry["timed_at"].endswith("UTC") and model.cpu_plans_timed == entry["timed_at"]
    found = cpu_plans.plan_layers(model)
    assert not found["halves"][0].cpu_plan.two_streams and found["head"][0].cpu_plan.two_streams
    assert cpu_plans.current(model) == entry["plans"]  # what bench reports
    cached = json.loads((tmp_path / "cpu-plans.json").read_text())
    assert list(cached.values()) == [entry]
    load_model(big_tiny[0])  # the same machine and shapes: read from the cache
    assert len(calls) == 1
    monkeypatch.setenv(cpu_plans.ENV, "on")  # forced: no measurement, no cache
    forced, _ = load_model(big_tiny[0])
    assert len(calls) == 1 and cpu_plans.plan_layers(forced)["halves"][0].cpu_plan.two_streams
    monkeypatch.setenv(cpu_plans.ENV, "halves=two,long_keys=512")  # the rest measured, not cached
    load_model(big_tiny[0])
    assert calls[-1] == {"halves": "two", "long_keys": 512}


@pytest.mark.parametrize(
    "value", ["fast", "cut=three", "long_keys=many", "dequantize_rows=x", "small=-1"]
)
def test_a_bad_plans_setting_names_the_variable_and_the_choices(value, monkeypatch):
    monkeypatch.setenv(cpu_plans.ENV, value)
    with pytest.raises(
        ValueError, match=r"MLXINFER_CPU_PLANS=.*expected 'on', 'off'.*cut: one/two"
    ):
        cpu_plans.forced_plans()


def test_a_float_prefill_on_the_cpu_backend_runs_stepwise(big_tiny):
    """The backend's prefill schedule evaluates attention block by block for float models too."""
    from mlxinfer.backends.cpu import quantized

    model, _ = load_model(big_tiny[0])
    assert model.backend == "cpu" and not cpu_plans.plan_layers(model)["quantized"]
    with backends.prefill_schedule(model):
        assert quantized.stepwise()
    assert not quantized.stepwise()


def test_the_crossover_is_where_the_other_option_wins_for_good(monkeypatch):
    """A threshold counts only if the other option is faster from it on, at every larger size."""
    clock = [0.0]  # a fake clock that only the timed runs move: the test times nothing
    monkeypatch.setattr(choices.time, "perf_counter", lambda: clock[0])

    def timer_for(faster_from, dip=None):
        def timer(size):
            def run(option):
                wins = size >= faster_from and size != dip
                clock[0] += 1e-3 if (option == "other") == wins else 2e-3

            return run

        return timer

    sizes = (2, 4, 8, 16)
    assert choices.crossover(sizes, timer_for(8), "plain", "other")[0] == 8
    assert choices.crossover(sizes, timer_for(4, dip=16), "plain", "other")[0] == cpu_plans.NEVER
    assert choices.crossover(sizes, timer_for(99), "plain", "other")[0] == cpu_plans.NEVER


def test_a_crossover_won_by_far_twice_times_no_larger_size(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(choices.time, "perf_counter", lambda: clock[0])
    timed = []

    def timer(size):
        timed.append(size)
        return lambda option: clock.__setitem__(
            0, clock[0] + (1e-3 if option == "other" and size >= 4 else 3e-3)
        )

    assert choices.crossover((2, 4, 8, 16, 32), timer, "plain", "other")[0] == 4
    assert timed == [2, 4, 8]


@pytest.mark.parametrize("weights", ["4-bit", "float without kernels"])
def test_single_runs_on_one_stream_with_the_kernels(weights, tmp_path, monkeypatch):
    """``single`` (what a distributed load sets: collectives from two streams corrupt each other):
    a model's prefill and decode never ask for the worker streams; a 4-bit model's products run
    on the compiled kernels where they are built; the logits are the plain MLX path's. A float
    model whose layers the two-stream plans would cut, with no kernels to take them: one stream
    still."""
    from mlxinfer.backends.cpu import compiled, parallel

    path, _ = make_tiny(tmp_path / "hf", tie_word_embeddings=True, **SHAPES)
    add_tokenizer(path)
    if weights == "4-bit":
        convert(path, tmp_path / "q", quantize=True, bits=4, group_size=64, dtype="float32")
        path = tmp_path / "q"
    else:
        monkeypatch.setattr(kernels, "load", lambda: None)
    ids = [(3 + 29 * i) % SHAPES["vocab_size"] for i in range(12)]
    monkeypatch.setenv(backends.ENV, "0")
    ref_prefill, ref_decode = decode_logits(load_model(path)[0], ids)
    monkeypatch.delenv(backends.ENV)
    monkeypatch.setenv(cpu_plans.ENV, "single")
    model, _ = load_model(path)
    asked, kernel_calls = [], []
    monkeypatch.setattr(parallel, "worker_streams", lambda: asked.append(1) or parallel._STREAMS)
    real = compiled.quantized_product
    monkeypatch.setattr(
        compiled, "quantized_product", lambda *a: kernel_calls.append(1) or real(*a)
    )
    prefill, decode = decode_logits(model, ids)
    assert not asked
    assert bool(kernel_calls) == (weights == "4-bit" and kernels.load() is not None)
    assert np.abs(prefill - ref_prefill).max() <= 1e-3
    assert np.abs(decode - ref_decode).max() <= 1e-4


def test_the_watch_counts_other_processes_cpu_time_not_its_own(monkeypatch):
    """Others' share = (machine's busy ticks - this process's) / (ticks per second x wall x CPUs):
    150 busy ticks over 1 s on 2 CPUs at 100 ticks/s, 50 of them ours, is half the machine."""
    from mlxinfer.backends.cpu import quiet

    machine, own, clock = [(1000, 2), (1150, 2)], [400, 450], [10.0, 11.0]
    monkeypatch.setattr(quiet, "_machine_ticks", lambda: machine.pop(0))
    monkeypatch.setattr(quiet, "_own_ticks", lambda: own.pop(0))
    monkeypatch.setattr(quiet.time, "monotonic", lambda: clock.pop(0))
    monkeypatch.setattr(quiet.os, "sysconf", lambda name: 100)
    with quiet.Watch() as w:
        pass
    assert w.others == pytest.approx(0.5) and w.busy


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc")
def test_the_watch_sees_other_processes_keep_every_cpu_busy():
    """A spinning child process on every CPU while this one sleeps: busy, by the real counters."""
    import subprocess
    import sys
    import time

    from mlxinfer.backends.cpu import quiet

    spin = "import time\nend = time.time() + 2.5\nwhile time.time() < end: pass"
    children = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)  # the children started
        with quiet.Watch() as w:
            time.sleep(1.0)
    finally:
        for c in children:
            c.wait(10)
    assert w.others is not None and w.others > 0.6 and w.busy


class _FakeWatch:
    def __init__(self, others):
        self.others, self.busy = others, others > 0.25

    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_a_choice_timed_on_a_busy_machine_is_used_but_not_cached(big_tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_plans.ENV, raising=False)
    calls = []

    def measured(model, fixed=None):
        calls.append(fixed)
        return {"plans": {"cut": "one", "halves": "two", "head": "one"}, "seconds": {}}

    monkeypatch.setattr(cpu_plans, "measure", measured)
    monkeypatch.setattr(cpu_plans, "confirm", lambda m, result: result)
    monkeypatch.setattr(cpu_plans.quiet, "Watch", _FakeWatch(0.8))
    logged = []
    model, _ = load_model(big_tiny[0], log=logged.append)
    assert cpu_plans.plan_layers(model)["halves"][0].cpu_plan.two_streams  # used for this run
    assert "busy machine, other work on 80% of the CPUs" in logged[0]
    assert not (tmp_path / "cpu-plans.json").exists()
    load_model(big_tiny[0])  # timed again: nothing was cached
    assert len(calls) == 2
    monkeypatch.setattr(cpu_plans.quiet, "Watch", _FakeWatch(0.05))
    load_model(big_tiny[0])
    cached = list(json.loads((tmp_path / "cpu-plans.json").read_text()).values())
    assert len(calls) == 3 and cached[0]["plans"]["halves"] == "two"
    assert cached[0]["others_load"] == 0.05
    load_model(big_tiny[0])  # now read from the cache ...
    assert len(calls) == 3
    monkeypatch.setenv(cpu_plans.ENV, "replan")  # ... unless told to time it again
    load_model(big_tiny[0])
    assert len(calls) == 4 and calls[-1] is None


def test_measured_plans_that_lose_to_the_default_as_a_whole_are_not_kept(big_tiny, monkeypatch):
    """``confirm`` times whole steps under the measured plans and the static default (here, with
    no kernels, the plainest options) and keeps the measured ones only if 3% faster."""
    monkeypatch.setattr(kernels, "load", lambda: None)
    model, _ = load_model(big_tiny[0])
    found = cpu_plans.plan_layers(model)
    assert timing.static_default(model) == {
        "cut": "one", "halves": "one", "head": "one", "fuse": "separate",
    }  # fmt: skip
    measured = {"cut": "two", "halves": "one", "head": "one", "fuse": "separate", "long_keys": 512}
    for cut_cost, kept in ((1.2, "default"), (1.01, "default"), (0.9, "measured")):

        class Step:
            scale = 1.0

            def __init__(self, model, timed=None):
                pass

            def blocks_seconds(self, steps=1, cost=cut_cost):
                return 0.004 * (cost if found["cut"][0].cpu_plan.two_streams else 1.0)

            def head_seconds(self, steps=1):
                return 0.001

        monkeypatch.setattr(timing, "DecodeStep", Step)
        result = timing.confirm(model, {"plans": dict(measured), "seconds": {}, "blocks_timed": 2})
        assert result["confirmed"]["kept"] == kept
        assert result["plans"]["cut"] == ("two" if kept == "measured" else "one")
        assert result["plans"]["long_keys"] == 512  # the numeric kinds stay as measured
        assert found["cut"][0].cpu_plan.two_streams == (kept == "measured")
