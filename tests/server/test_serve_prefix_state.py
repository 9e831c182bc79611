"""`mlxinfer serve --prefix-state-bytes N --prefix-state-every BLOCKS` (issue #30): the
recurrent-state snapshots' budget and spacing reach the served model's Engine
(``state_budget``, ``state_every``); bad values are usage errors naming the flag.

The model is a tiny random LFM2 (convolution layers: recurrent state) written by mlxinfer
itself; the server is built as ``serve`` builds it, with uvicorn's run replaced by a stub.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from tiny_checkpoint import write_checkpoint

from mlxinfer.batch.pool import DEFAULT_KV_BUDGET
from mlxinfer.batch.snapshots import DEFAULT_STATE_SHARE
from mlxinfer.cli.main import cli

LFM2 = dict(
    model_type="lfm2",
    num_hidden_layers=4,
    layer_types=["conv", "full_attention", "conv", "conv"],
    conv_L_cache=3,
    block_multiple_of=64,
)


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lfm2"), **LFM2)


@pytest.fixture
def served(monkeypatch):
    """The engines `serve` would run: uvicorn's server replaced by one that records the app."""
    import mlxinfer.server.run as run

    engines = []

    class Stub:
        def __init__(self, app):
            self.app = app

        def run(self):
            registry = self.app.state.models
            engines.extend(entry.engine for entry in registry.entries.values())
            registry.close()

    monkeypatch.setattr(run, "server", lambda app, host, port, **kw: Stub(app))
    return engines


def _serve(*args):
    return CliRunner().invoke(cli, ["serve", *args], catch_exceptions=False)


BUDGET = ["--kv-budget", "4194304"]  # a small pool: reserved at start


def test_the_flags_reach_the_engine(lfm2_dir, served):
    result = _serve(
        "-m", str(lfm2_dir), *BUDGET, "--prefix-state-bytes", "64K", "--prefix-state-every", "3"
    )
    assert result.exit_code == 0, result.output
    [engine] = served
    assert engine.recurrent
    assert (engine.snapshots.max_bytes, engine.config.state_every) == (64 * 1024, 3)


def test_without_the_flags_the_engine_defaults_hold(lfm2_dir, served):
    """A quarter of the KV budget, a snapshot per prefill chunk (Engine's documented defaults);
    `--prefix-state-bytes 0` turns the snapshots off."""
    assert _serve("-m", str(lfm2_dir), *BUDGET).exit_code == 0
    assert _serve("-m", str(lfm2_dir), *BUDGET, "--prefix-state-bytes", "0").exit_code == 0
    default, off = served
    assert default.snapshots.max_bytes == 4194304 // DEFAULT_STATE_SHARE
    assert default.config.state_every == default.prefill_step // default.pool.block_size
    assert off.snapshots is None


@pytest.mark.parametrize(
    "args, flag, found",
    [
        (["--prefix-state-bytes", "12X"], "--prefix-state-bytes", "'12X'"),
        (["--prefix-state-bytes", "-1"], "--prefix-state-bytes", "'-1'"),
        (["--prefix-state-bytes", "2G"], "--prefix-state-bytes", str(2 << 30)),
        (
            ["--kv-budget", "1000", "--prefix-state-bytes", "1001"],
            "--prefix-state-bytes",
            "1001",
        ),
        (["--prefix-state-every", "0"], "--prefix-state-every", "0"),
        (["--prefix-state-every", "two"], "--prefix-state-every", "two"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(args, flag, found, served):
    """Refused before any model loads (no -m: the default model is never fetched)."""
    result = _serve(*args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}'" in result.output
    assert found in result.output
    assert served == []
    assert DEFAULT_KV_BUDGET < 2 << 30  # the 2G case exceeds the default budget
