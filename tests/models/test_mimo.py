"""MiMo: a Qwen2 trunk plus an MTP head, against transformers (tiny random checkpoints).

transformers has no MiMo model: the trunk is its Qwen2, the head its ``MtpLayer`` with
``mtp_hidden_states_first`` (MiMo's [h, e] order) over a Qwen2 block, loaded with the same
tensors (tests/support/mtp_models.py). No real MTP weights can be had here.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from hf_models import add_tokenizer, torch_greedy
from mtp_models import make_mimo, strip_heads
from safetensors import safe_open
from transformers.cache_utils import MtpCache

from mlxinfer import load
from mlxinfer.errors import DraftError
from mlxinfer.generation import generate_step
from mlxinfer.generation.mtp_drafts import MTP
from mlxinfer.generation.speculative import speculative_generate_step
from mlxinfer.loading.convert import convert

IDS = [5, 17, 33, 2, 99, 120, 7, 64, 3, 11, 42, 42, 8]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path, trunk, mtp = make_mimo(tmp_path_factory.mktemp("mimo") / "m")
    add_tokenizer(path)
    model, _ = load(path)
    return path, trunk, mtp, model


def reference_head(trunk, mtp, ids, chain: int = 0):
    """transformers: the head over the pairs (h_j, x_{j+1}) at positions j+1, then ``chain``
    more steps on its own output and its own greedy token (as MtpModel chains its layers)."""
    T = len(ids)
    with torch.no_grad():
        h = trunk(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        cache = MtpCache(config=trunk.config.get_mtp_config())
        g = mtp.forward_layer(
            0, h[:, :-1], torch.arange(1, T)[None], cache, input_ids=torch.tensor([ids[1:]])
        )
        out = [mtp._project_to_logits(g)[0].numpy()]
        for i in range(chain):
            token = int(out[-1][-1].argmax())
            g = mtp.forward_layer(
                0, g[:, -1:], torch.tensor([[T + i]]), cache, input_ids=torch.tensor([[token]])
            )
            out.append(mtp._project_to_logits(g)[0].numpy())
    return np.concatenate(out)


def test_trunk_matches_transformers_qwen2(pair):
    _, trunk, _, model = pair
    hidden, logits = model.trunk(mx.array([IDS]))
    with torch.no_grad():
        ref = trunk(torch.tensor([IDS]), output_hidden_states=True)
    np.testing.assert_allclose(np.array(logits[0]), ref.logits[0].numpy(), atol=1e-3)
    # What the head reads: the states after the final norm (transformers' hidden_states[-1]).
    np.testing.assert_allclose(np.array(hidden[0]), ref.hidden_states[-1][0].numpy(), atol=1e-3)
    plain = [t for t, _ in generate_step(IDS, model, max_tokens=12)]
    assert plain == torch_greedy(trunk, IDS, 12)


def test_head_logits_match_transformers_mtp_layer(pair):
    _, trunk, mtp, model = pair
    ref = reference_head(trunk, mtp, IDS, chain=2)  # (T-1 + 2, V)
    hidden, _ = model.trunk(mx.array([IDS]))
    head = model.mtp_heads[0]
    # Without a cache: all pairs at once.
    g = head(mx.array([IDS[1:]]), hidden[:, :-1], None)
    np.testing.assert_allclose(np.array(head.logits(g)[0]), ref[: len(IDS) - 1], atol=1e-3)
    # With its cache, one pair at a time, then chained on its own output and greedy token (k = 3).
    cache = head.make_cache()
    rows = []
    for j in range(len(IDS) - 1):
        g = head(mx.array([[IDS[j + 1]]]), hidden[:, j : j + 1], cache)
        rows.append(np.array(head.logits(g)[0, 0]))
    for _ in range(2):
        token = mx.array([[int(np.argmax(rows[-1]))]])
        g = head(token, g, cache)
        rows.append(np.array(head.logits(g)[0, 0]))
    np.testing.assert_allclose(np.stack(rows), ref, atol=1e-3)


def test_the_config_names_the_heads_and_the_weights_have_them(pair):
    path, _, _, model = pair
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert len(model.mtp_heads) == 1
    assert "input_proj" in model.model.mtp_layers[0]


def test_a_checkpoint_with_stripped_heads_loads_without_them(pair, tmp_path):
    import shutil

    path = strip_heads(shutil.copytree(pair[0], tmp_path / "stripped"))
    model, _ = load(path)  # config.json still says num_nextn_predict_layers: 1
    assert model.mtp_heads == []
    plain = [t for t, _ in generate_step(IDS, model, max_tokens=6)]
    assert plain == [t for t, _ in generate_step(IDS, pair[3], max_tokens=6)]
    with pytest.raises(DraftError, match="has no MTP heads"):
        MTP().check(model, None)


@pytest.mark.parametrize("quantize", [False, True])
def test_convert_keeps_the_heads(pair, tmp_path, quantize):
    path, _, _, model = pair
    out = tmp_path / ("q4" if quantize else "f16")
    if quantize:
        convert(path, out, quantize=True, bits=4, group_size=32)
    else:
        convert(path, out, dtype="float16")
    keys = {}
    for file in out.glob("model*.safetensors"):
        with safe_open(str(file), "np") as f:
            keys.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    head = "model.mtp_layers.0."
    assert f"{head}input_proj.weight" in keys and f"{head}mlp.down_proj.weight" in keys
    assert (f"{head}input_proj.scales" in keys) == quantize  # quantized like the trunk's
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm", "input_layernorm"):
        assert keys[f"{head}{norm}.weight"].startswith(("F", "BF"))  # norms stay float
    converted, _ = load(out)
    assert len(converted.mtp_heads) == 1
    plain = [t for t, _ in generate_step(IDS, converted, max_tokens=10)]
    drafted = [s[0] for s in speculative_generate_step(IDS, converted, MTP(), max_tokens=10)]
    assert drafted == plain


@pytest.mark.parametrize("key", ["num_nextn_predict_layers"])
@pytest.mark.parametrize("value", [-1, 10**9, "1"])
def test_a_head_count_out_of_bounds_is_a_config_error(key, value):
    from mlxinfer.errors import ConfigError
    from mlxinfer.models import build_model

    config = dict(
        model_type="mimo",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=256,
    )
    with pytest.raises(ConfigError, match=key):
        build_model({**config, key: value})
