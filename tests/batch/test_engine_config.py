"""The engine's settings as one object: ``Engine(model, config=EngineConfig(...))`` is the engine
``Engine(model, **keywords)`` makes, the old keyword names (``reserve``, ``state_budget``,
``state_every``) set the fields named as the CLI's flags are, and a misspelt one is a TypeError."""

from __future__ import annotations

import pytest
from tiny_checkpoint import write_checkpoint

from mlxinfer.batch import Engine, EngineConfig
from mlxinfer.batch.config import ALIASES
from mlxinfer.loading.loader import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, _ = load_model(write_checkpoint(tmp_path_factory.mktemp("tiny")))
    return model


def test_a_config_and_keywords_make_the_same_engine(tiny):
    config = EngineConfig(block_size=8, kv_budget=1 << 20, max_batch=3, kv_reserve=True)
    with Engine(tiny, config=config) as a:
        tokens_a = [s.token for s in a.submit([5, 6, 7, 8], max_tokens=6).steps()]
    with Engine(tiny, block_size=8, kv_budget=1 << 20, max_batch=3, reserve=True) as b:
        tokens_b = [s.token for s in b.submit([5, 6, 7, 8], max_tokens=6).steps()]
    assert a.config == b.config == config
    assert (
        a.stats().nbytes
        == b.stats().nbytes
        == (1 << 20) // a.pool.bytes_per_block * (a.pool.bytes_per_block)
    )  # reserved from the start: the whole budget's blocks
    assert tokens_a == tokens_b


def test_keywords_override_the_config_and_the_old_names_are_aliases():
    base = EngineConfig(max_batch=2)
    assert base.with_options(max_batch=5).max_batch == 5
    config = base.with_options(reserve=True, state_budget=123, state_every=2)
    assert (config.kv_reserve, config.prefix_state_bytes, config.prefix_state_every) == (
        True,
        123,
        2,
    )
    assert set(ALIASES.values()) <= {f for f in EngineConfig.__dataclass_fields__}


def test_a_misspelt_or_twice_given_setting_is_a_type_error(tiny):
    with pytest.raises(TypeError, match="kv_budjet"):
        Engine(tiny, kv_budjet=1)
    with pytest.raises(TypeError, match="kv_reserve"):
        EngineConfig().with_options(reserve=True, kv_reserve=False)


def test_bad_values_are_refused_when_the_config_is_made():
    with pytest.raises(ValueError, match="max_batch"):
        EngineConfig(max_batch=0)
    with pytest.raises(ValueError, match="attention"):
        EngineConfig(attention="flash")
    with pytest.raises(ValueError, match="state_every"):
        EngineConfig().with_options(state_every=0)


def test_serve_names_each_engine_setting_as_the_library_does():
    """One name for one setting: each of serve's flags that sets the engine is the config field
    spelled as a flag (``kv_reserve`` is ``--kv-reserve``, its off switch ``--kv-grow``)."""
    from mlxinfer.cli.main import cli

    names = {f for f in EngineConfig.__dataclass_fields__}
    params = {p.name: p for p in cli.commands["serve"].params}
    engine = sorted(n for n in params if n in names)
    assert engine == [
        "kv_bits",
        "kv_budget",
        "kv_reserve",
        "max_batch",
        "prefix_cache_dir",
        "prefix_cache_disk_bytes",
        "prefix_state_bytes",
        "prefix_state_every",
    ]
    for name in engine:
        assert params[name].opts == ["--" + name.replace("_", "-")]
    assert params["kv_reserve"].secondary_opts == ["--kv-grow"]
    generate = {p.name: p for p in cli.commands["generate"].params}
    assert generate["temperature"].opts == ["--temperature", "--temp"]
