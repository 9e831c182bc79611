"""Logit parity with transformers on tiny random Llama-family checkpoints.

Spec: f32 logits within 1e-3 of transformers on the same weights, with and
without the KV cache; greedy tokens identical; both config.json forms.
"""

import mlx.core as mx
import numpy as np
import pytest
from hf_models import make_tiny, torch_greedy, torch_logits, torch_logits_chunked

from mlxinfer import backends
from mlxinfer.generation import generate_step
from mlxinfer.loading.loader import load_model

TOL = 1e-3
IDS = [3, 17, 99, 5, 240, 8, 8, 61, 130, 2, 77, 19, 200, 45, 1, 33, 150, 9, 12, 255, 4, 60, 91, 101]

CASES = {
    "llama-v5": dict(model_type="llama"),
    "llama-v4": dict(model_type="llama", config_form="v4"),
    "llama-mha-bias-tied": dict(
        model_type="llama",
        num_key_value_heads=4,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    ),
    "llama-mqa-head_dim": dict(model_type="llama", num_key_value_heads=1, head_dim=32),
    "mistral-v5": dict(model_type="mistral", sliding_window=None),
    "mistral-v4": dict(model_type="mistral", config_form="v4", sliding_window=None),
    "mistral-window8": dict(model_type="mistral", sliding_window=8),
    "rope-linear": dict(
        model_type="llama",
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    ),
    "rope-linear-v4": dict(
        model_type="llama",
        config_form="v4",
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    ),
    "rope-dynamic": dict(
        model_type="llama",
        max_position_embeddings=16,
        rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
    ),
    "rope-llama3": dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 500000.0,
        },
    ),
    "rope-yarn": dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
    ),
}


@pytest.fixture(scope="module", params=["cpu-backend", "plain-mlx"])
def ops_path(request):
    """Both paths: the CPU backend's layers, and the models as written (mx.fast: Metal's path,
    here its reference graph). Models are loaded under the setting and keep their backend."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(backends.ENV, "1" if request.param == "cpu-backend" else "0")
        yield request.param


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory, ops_path):
    spec = dict(CASES[request.param])
    path, torch_model = make_tiny(
        tmp_path_factory.mktemp(request.param), perturb_vectors=True, **spec
    )
    model, _ = load_model(path)
    assert model.backend == backends.name()
    return request.param, model, torch_model


def test_full_forward_matches_transformers(pair):
    _, model, torch_model = pair
    ref = torch_logits(torch_model, IDS)
    out = np.array(model(mx.array([IDS]))[0])
    assert np.abs(out - ref).max() <= TOL


def test_chunked_prefill_then_decode_matches_transformers(pair):
    name, model, torch_model = pair
    chunks = [IDS[:5], IDS[5:12], IDS[12:13]] + [[t] for t in IDS[13:]]
    cache = model.make_cache()
    out = np.concatenate([np.array(model(mx.array([c]), cache)[0]) for c in chunks])
    assert cache[0].offset == len(IDS)
    assert np.abs(out - torch_logits_chunked(torch_model, chunks)).max() <= TOL
    if name != "rope-dynamic":
        # Dynamic NTK rescales all positions once a sequence outgrows the context,
        # so only there does one full pass differ from prefill + decode (as in transformers).
        assert np.abs(out - torch_logits(torch_model, IDS)).max() <= TOL


def test_greedy_tokens_identical(pair):
    _, model, torch_model = pair
    prompt = IDS[:6]
    ref = torch_greedy(torch_model, prompt, 32)
    ours = [t for t, _ in generate_step(prompt, model, max_tokens=32, prefill_step_size=4)]
    assert ours == ref
