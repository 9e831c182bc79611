"""Measured mixed precision under a size budget (issue 48, items 4 and 5).

The planner's parts against derivations: the knapsack against brute force, the calibration
statistics against the layer inputs computed by hand, each probe's KL against a full forward
pass and a numpy KL; then whole conversions of a tiny model: within the budget, the head
protected, overrides kept, the importance file saved and reused to the same plan.
"""

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from hf_models import add_tokenizer, make_tiny
from mlx.utils import tree_flatten

import mlxinfer
from mlxinfer.cli.main import cli
from mlxinfer.errors import ConfigError
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model
from mlxinfer.quant.budget import choose
from mlxinfer.quant.calibrate import Probe, collect_importance
from mlxinfer.quant.plan import Setting, Tensor, fake_quantized, parse_overrides
from mlxinfer.quant.rounding import channel_weights, fit_affine


class _Weight:
    def __init__(self, n):
        self.weight = mx.zeros((n,))


def _tensor(name, n, costs):
    t = Tensor(name, _Weight(n), "linear", list(costs))
    t.errors, t.alpha = dict(costs), 1.0
    return t


def test_choice_is_the_cheapest_plan_within_the_budget_brute_force():
    rng = np.random.default_rng(0)
    settings = [Setting(b, g) for b in (2, 3, 4, 6, 8) for g in (32, 128)]
    for trial in range(20):
        tensors = []
        for i in range(3):
            n = int(rng.choice([1024, 4096, 8192]))
            scale = float(rng.uniform(0.1, 10))
            # cost falls with bits (4x a bit, as squared error does) and rises with group size
            costs = {s: scale * 4.0 ** (-s.bits) * (1 + s.group_size / 256) for s in settings}
            tensors.append(_tensor(f"t{i}", n, costs))
        sizes = [[s.nbytes(t.numel) for s in settings] for t in tensors]
        budget = int(rng.uniform(sum(min(x) for x in sizes), sum(max(x) for x in sizes)))
        best = min(
            (
                sum(t.cost(s) for t, s in zip(tensors, combo))
                for combo in itertools.product(settings, repeat=3)
                if sum(s.nbytes(t.numel) for t, s in zip(tensors, combo)) <= budget
            )
        )
        plan = choose(tensors, budget)
        assert sum(plan[t.path].nbytes(t.numel) for t in tensors) <= budget
        got = sum(t.cost(plan[t.path]) for t in tensors)
        assert got <= best * 1.05 + 1e-12, (trial, got, best)


def test_a_budget_below_the_smallest_plan_is_one_line():
    t = _tensor("t", 4096, {Setting(2, 128): 1.0})
    with pytest.raises(ConfigError, match="size budget: expected at least"):
        choose([t], 10)


@pytest.mark.parametrize("spec", ["v_proj", "v_proj=7", "v_proj=4:48", "=4", "(=4", "v_proj=four"])
def test_bad_tensor_bits_are_one_line(spec):
    with pytest.raises(ConfigError, match="--tensor-bits"):
        parse_overrides([spec])


def test_weighted_fit_favours_the_important_channels():
    rng = np.random.default_rng(1)
    w = mx.array(rng.standard_t(3, (64, 256)).astype(np.float32) * 0.02)
    importance = np.ones(256, np.float32)
    importance[::8] = 100.0  # every 8th input channel carries most of the signal
    v = channel_weights(importance, w.shape)

    def err(fit, weights):
        dq = mx.dequantize(*fit, group_size=64, bits=3)
        return float((weights * mx.square(dq - w)).sum())

    plain, weighted = (
        fit_affine(w, group_size=64, bits=3),
        fit_affine(w, group_size=64, bits=3, weights=v),
    )
    assert err(weighted, v) < 0.9 * err(plain, v)
    minmax = mx.quantize(w, group_size=64, bits=3)
    assert err(weighted, v) <= err(minmax, v)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    src, _ = make_tiny(root / "hf", vocab_size=320, tie_word_embeddings=True)
    add_tokenizer(src)
    convert(src, root / "f32", dtype="float32")
    (root / "calib.txt").write_text(
        " ".join(f"word{i % 97} and number {i * 7 % 113}." for i in range(800))
    )
    return root


IDS = [[1, 5, 9, 2, 7, 300, 11, 4, 18, 6, 3, 250, 40, 41, 42, 17]]


def _numpy_logp(logits):
    x = np.asarray(logits, np.float64)
    return (
        x
        - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - x.max(-1, keepdims=True)
    )


def test_calibration_sums_are_the_layer_inputs_squared(tiny):
    model, _ = load_model(tiny / "f32")
    sums, counts = collect_importance(model, IDS)
    # The first block's attention projections all read the first RMSNorm of the embeddings.
    inner = model.model
    x = inner.layers[0].input_layernorm(inner.embed_tokens(mx.array(IDS)))
    want = np.square(np.array(x, np.float64)).reshape(-1, x.shape[-1]).sum(0)
    for name in ("q_proj", "k_proj", "v_proj"):
        got = sums[f"model.layers.0.self_attn.{name}"]
        np.testing.assert_allclose(got, want, rtol=1e-4)
        assert int(counts[f"model.layers.0.self_attn.{name}"]) == len(IDS[0])
    rows = sums["model.embed_tokens#rows"]
    np.testing.assert_array_equal(rows, np.bincount(IDS[0], minlength=rows.shape[0]))
    # The tied head reads the inner model's output (after its final norm).
    h = inner(mx.array(IDS))
    want = np.square(np.array(h, np.float64)).reshape(-1, h.shape[-1]).sum(0)
    np.testing.assert_allclose(sums["model.embed_tokens"], want, rtol=1e-4)


def test_probe_kl_equals_a_full_forward_and_numpy(tiny):
    model, _ = load_model(tiny / "f32")
    probe = Probe(model, IDS, 320)
    assert probe.kl() == 0.0
    ref = _numpy_logp(model(mx.array(IDS))[0])
    layer = model.model.layers[1].mlp.down_proj  # late: blocks before it are replayed
    changed = fake_quantized(layer.weight, Setting(2, 32))
    got = probe.kl_with(layer, changed)
    original = layer.weight
    layer.weight = changed
    new = _numpy_logp(model(mx.array(IDS))[0])
    layer.weight = original
    want = float((np.exp(ref) * (ref - new)).sum(-1).mean())
    assert want > 1e-4
    assert got == pytest.approx(want, rel=1e-3)
    assert probe.kl() == 0.0  # the weight is back


def test_budgeted_conversion_fits_protects_the_head_and_reuses_its_importance(tiny):
    f32 = tiny / "f32"
    params = sum(v.size for _, v in tree_flatten(load_model(f32)[0].parameters()))
    for bpw in (4.5, 6.0):
        out = tiny / f"bpw{bpw}"
        events: list = []
        report = convert(
            f32,
            out,
            bpw=bpw,
            calibration=tiny / "calib.txt",
            progress=lambda *e, seen=events: seen.append(e),
        )
        last = {stage: (done, total) for stage, done, total in events}
        assert set(last) == {
            "reading weights",
            "calibration",
            "measuring tensors",
            "writing weights",
        }
        assert all(done == total > 0 for done, total in last.values())
        size = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
        assert size * 8 / params <= bpw + 1e-9
        assert size * 8 / params >= bpw - 0.6  # spends the budget, not far below it
        record = json.loads((out / "config.json").read_text())["quantization"]
        assert record["model.embed_tokens"]["bits"] >= 4  # the tied head's floor
        assert report["measured_kl"] >= 0
        model, _ = mlxinfer.load(out)
        assert np.isfinite(np.array(model(mx.array(IDS)))).all()
    # The saved importance gives the same plan without a calibration pass.
    again = tiny / "again"
    saved = tiny / "bpw4.5" / "imatrix.safetensors"
    convert(f32, again, bpw=4.5, imatrix=saved, calibration=tiny / "calib.txt")
    first = json.loads((tiny / "bpw4.5" / "config.json").read_text())["quantization"]
    assert json.loads((again / "config.json").read_text())["quantization"] == first
    # A saved plan's measured costs plan another budget to what measuring again gives.
    reused = tiny / "reused"
    convert(
        f32,
        reused,
        bpw=6.0,
        imatrix=saved,
        calibration=tiny / "calib.txt",
        plan_from=tiny / "bpw4.5" / "quantization-plan.json",
    )
    measured = json.loads((tiny / "bpw6.0" / "config.json").read_text())["quantization"]
    assert json.loads((reused / "config.json").read_text())["quantization"] == measured
    with pytest.raises(ConfigError, match="--plan-from .*config.json: expected a"):
        convert(f32, tiny / "bad", bpw=6.0, plan_from=tiny / "bpw4.5" / "config.json")


def test_max_bytes_overrides_and_the_cli(tiny):
    out = tiny / "cli"
    result = CliRunner().invoke(
        cli,
        [
            "convert",
            str(tiny / "f32"),
            "-o",
            str(out),
            "--max-bytes",
            "200K",
            "--tensor-bits",
            r"layers\.0\..*v_proj=8:32",
            "--calibration",
            str(tiny / "calib.txt"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "plan:" in result.output and "measured" in result.output
    size = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    assert size <= 200_000
    record = json.loads((out / "config.json").read_text())["quantization"]
    assert record["model.layers.0.self_attn.v_proj"] == {
        "group_size": 32,
        "bits": 8,
        "mode": "affine",
    }
    bad = CliRunner().invoke(
        cli, ["convert", str(tiny / "f32"), "-o", str(tiny / "x"), "--bpw", "4", "--bits", "4"]
    )
    assert bad.exit_code != 0 and "one or the other" in bad.output
    for value in ("lots", "0", "-5M", "nan", "1e400"):
        bad = CliRunner().invoke(
            cli, ["convert", str(tiny / "f32"), "-o", str(tiny / "x"), "--max-bytes", value]
        )
        assert bad.exit_code == 2, (value, bad.output)  # click's usage error: no traceback
        assert "90M" in bad.output and not (tiny / "x").exists(), value


def test_the_head_never_goes_below_four_bits_unless_nothing_else_fits():
    from mlxinfer.quant.budget import protect_head

    def head(n):
        return Tensor("lm_head", _Weight(n), "head", [Setting(b, 64) for b in (2, 3, 4, 5, 6, 8)])

    block = _tensor("block", 64 * 64, {Setting(2, 64): 1.0, Setting(8, 64): 0.0})
    h = head(1000 * 64)
    # 4-bit group 64: 4.5 bits a weight = 36,000 bytes; the block at 2 bits: 1,280 bytes.
    assert protect_head([h, block], 36_000 + 1_280) == 4
    assert min(s.bits for s in h.candidates) == 4
    h = head(1000 * 64)
    assert protect_head([h, block], 36_000 + 1_279) is None  # 4 bits cannot fit: no floor
    assert min(s.bits for s in h.candidates) == 2


def test_the_heads_floor_yields_only_where_it_doubles_the_predicted_kl():
    """``choose_with_head``: the head kept at 4 bits or more, unless that plan's predicted KL (the
    summed measured costs) is twice the one without the floor or more; then the plan without it,
    and the head's candidates all kept. 64,000 weights each, group 64 (16-bit scale and bias):
    2-bit 20,000 bytes, 3-bit 28,000, 4-bit 36,000, 8-bit 68,000."""
    from mlxinfer.quant.budget import choose_with_head

    s2, s3, s4, s8 = (Setting(b, 64) for b in (2, 3, 4, 8))

    def plan(head3_cost):
        h = Tensor("lm_head", _Weight(64_000), "head", [s2, s3, s4])
        h.errors, h.alpha = {s2: 5.0, s3: head3_cost, s4: 0.05}, 1.0
        block = _tensor("block", 64_000, {s2: 1.0, s8: 0.0})
        # 96,100 bytes (the knapsack rounds sizes up to its units): without the floor the
        # 3-bit head and the 8-bit block (96,000; cost head3_cost); with it the 4-bit head
        # leaves the block 2 bits (36,000 + 20,000; cost 1.05)
        return h, choose_with_head([h, block], 96_100)

    h, (settings, floor) = plan(0.5)  # 1.05 >= 2 x 0.5: the floor yields
    assert floor is None and settings == {"lm_head": s3, "block": s8}
    assert h.candidates == [s2, s3, s4]  # all kept
    h, (settings, floor) = plan(0.6)  # 1.05 < 2 x 0.6: kept
    assert floor == 4 and settings == {"lm_head": s4, "block": s2}
    assert min(s.bits for s in h.candidates) == 4


def test_bad_plan_input_is_one_line_and_writes_nothing(tiny):
    f32, out = tiny / "f32", tiny / "never"
    (tiny / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    cases = [
        (dict(bpw=40.0), "--bpw: expected bits per weight in 1..16, found 40.0"),
        (dict(max_bytes=1000), "size budget: expected at least"),
        (dict(bpw=4.5, calibration=tiny / "absent.txt"), "--calibration"),
        (dict(bpw=4.5, calibration=tiny / "latin1.txt"), "expected UTF-8 text, found byte 0xe9"),
        (dict(bpw=4.5, bits=4), "one or the other"),
        (dict(quantize=True, bits=4, calibration=tiny / "calib.txt"), "apply to a mixed plan"),
        (dict(bpw=4.5, recipe="q4_k_m"), "one of --bpw, --max-bytes or --recipe"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError) as e:
            convert(f32, out, **kwargs)
        assert message in str(e.value) and "\n" not in str(e.value), kwargs
        assert not out.exists()


def test_inputs_narrower_than_the_probe_group_are_planned(tmp_path):
    """A model whose layers read 32 inputs (tiny checkpoints, the store's default recipe):
    each tensor's sensitivity is probed at 3 bits in its own widest group (32 here, not
    PROBE's 64, which MLX cannot quantize), and -q plans and loads."""
    from tiny_checkpoint import write_checkpoint

    write_checkpoint(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "q", quantize=True)
    record = json.loads((tmp_path / "q" / "quantization-plan.json").read_text())
    assert record["settings"] and all(
        int(s.split(":")[1]) == 32 for p, s in record["settings"].items() if "q_proj" in p
    )
    model, _ = load_model(tmp_path / "q")
    assert model.layers[0].self_attn.q_proj.bits in (2, 3, 4, 5, 6, 8)
