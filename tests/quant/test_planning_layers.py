"""A plan's passes run with the CPU backend's math (``backends.planning_layers``): its norms,
RoPE, attention and gated MLPs (a prompt's kernels) with no weight laid out anew, so each probe's
swapped weight is what runs. The plan is the one MLX's own ops give (``MLXINFER_CPU_OPS=0``):
the same settings, each measured cost within the kernels' float differences; the model's
classes are its own again afterwards."""

import mlx.core as mx
import pytest
from test_plan_streaming import BASE, FAMILIES, _lazy, _save, _tokens

from mlxinfer import backends
from mlxinfer.backends.cpu import layers as cpu_layers
from mlxinfer.quant import mixed

pytestmark = pytest.mark.skipif(
    mx.default_device().type != mx.DeviceType.cpu, reason="the CPU backend's layers"
)


@pytest.mark.parametrize("family", ["llama-tied", "gemma3_text"])
def test_a_plan_with_the_cpu_math_is_the_plan_mlxs_ops_give(tmp_path, monkeypatch, family):
    config = {**BASE, **FAMILIES[family]}
    file = _save(tmp_path, config)
    kwargs = dict(vocab=256, bpw=4.5, calibration_tokens=600, probe_tokens=96)
    model, fresh = _lazy(config, file)
    classes = {name: type(m) for name, m in model.named_modules()}
    seen: set[str] = set()
    real = backends.planning_layers

    def recording(m):
        context = real(m)

        class Recorded:
            def __enter__(self):
                context.__enter__()
                seen.update(type(x).__name__ for _, x in m.named_modules())

            def __exit__(self, *exc):
                return context.__exit__(*exc)

        return Recorded()

    monkeypatch.setattr(mixed.backends, "planning_layers", recording)
    got = mixed.plan_model(model, _tokens(), weights=fresh, **kwargs)
    mixins = {mixin.__name__ for _, mixin in cpu_layers.MIXINS}
    assert {name.split("[")[0] for name in seen} & mixins >= {"CPUAttention", "CPUGatedMLP"}
    assert {name: type(m) for name, m in model.named_modules()} == classes  # restored
    assert not any(k.startswith("_cpu_") for _, m in model.named_modules() for k in m.__dict__)

    monkeypatch.setenv(backends.ENV, "0")  # MLX's own ops for every pass
    plain_model, plain_fresh = _lazy(config, file)
    want = mixed.plan_model(plain_model, _tokens(), weights=plain_fresh, **kwargs)
    assert got.settings == want.settings
    # Each cost within 1e-3 of itself or of the largest: a tiny KL (1e-6 nats) is at float32's
    # own noise, where the kernels' sums and MLX's differ (1.5e-7 here at most).
    largest = max(cost["alpha"] for cost in want.costs.values())
    for path, cost in want.costs.items():
        assert got.costs[path]["alpha"] == pytest.approx(
            cost["alpha"], rel=1e-3, abs=1e-3 * largest
        ), path
    assert got.measured_kl == pytest.approx(want.measured_kl, rel=1e-3)
