"""The CPU backend's float decode plans: each choice gives transformers' outputs, and the choice
is measured once per machine and model, then cached (models/cpu_plans.py)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from hf_models import make_tiny, torch_logits

from mlxinfer.loader import load_model
from mlxinfer.models import cpu_plans

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


def test_every_plan_choice_matches_transformers(big_tiny, monkeypatch):
    """Plans forced on and off: prefill and one-row decode logits within 1e-3 of transformers'."""
    path, torch_model = big_tiny
    monkeypatch.setenv(cpu_plans.ENV, "on")
    model, _ = load_model(path)
    layers = cpu_plans.float_plan_layers(model)
    assert layers["cut"] and layers["halves"] and layers["head"]  # every plan is there to switch
    ids = [(5 + 37 * i) % SHAPES["vocab_size"] for i in range(12)]
    expected = torch_logits(torch_model, ids)
    for on in (True, False):
        cpu_plans.set_float_plans(model, on)
        cache = model.make_cache()
        prefill = np.array(model(mx.array([ids[:-1]]), cache)[0])
        decode = np.array(model(mx.array([ids[-1:]]), cache)[0, -1])  # one row: the plans' path
        assert np.abs(prefill - expected[:-1]).max() <= 1e-3, on
        assert np.abs(decode - expected[-1]).max() <= 1e-3, on


def test_the_faster_choice_is_kept(big_tiny, monkeypatch):
    """``measure`` keeps the plans only when the model's decode steps are faster with them."""
    model, _ = load_model(big_tiny[0])
    for plans_cost, keep in ((0.5, True), (2.0, False)):

        def step_seconds(m, steps, plans_cost=plans_cost):
            on = cpu_plans.float_plan_layers(m)["halves"][0].__dict__["_halves"]
            return 0.01 * (plans_cost if on else 1.0)

        monkeypatch.setattr(cpu_plans, "decode_step_seconds", step_seconds)
        result = cpu_plans.measure(model)
        assert result["on"] is keep and result["steps"] >= 2


def test_choice_is_measured_once_and_cached(big_tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_plans.ENV, raising=False)
    calls = []
    monkeypatch.setattr(
        cpu_plans,
        "measure",
        lambda m: (
            calls.append(m) or {"on": False, "step_s_off": 1e-3, "step_s_on": 2e-3, "steps": 2}
        ),
    )
    logged = []
    model, _ = load_model(big_tiny[0], log=logged.append)
    assert len(calls) == 1 and "CPU float plans off" in logged[0]
    assert not cpu_plans.float_plan_layers(model)["halves"][0].__dict__["_halves"]
    assert type(cpu_plans.float_plan_layers(model)["cut"][0]).__name__ == "Linear"
    cached = json.loads((tmp_path / "cpu-plans.json").read_text())
    assert list(cached.values()) == [
        {"on": False, "step_s_off": 1e-3, "step_s_on": 2e-3, "steps": 2}
    ]
    load_model(big_tiny[0])  # the same machine and shapes: read from the cache
    assert len(calls) == 1
    monkeypatch.setenv(cpu_plans.ENV, "on")  # forced: no measurement, no cache
    forced, _ = load_model(big_tiny[0])
    assert len(calls) == 1 and cpu_plans.float_plan_layers(forced)["halves"][0].__dict__["_halves"]
