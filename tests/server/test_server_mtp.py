"""``serve --mtp`` / ``make_app(draft=MTP())``: chat completions drafted by the model's own MTP
head in the server's engine give the text plain decoding gives (a tiny random MiMo checkpoint
built with transformers; no real MTP weights can be had here)."""

import pytest
from hf_models import add_tokenizer, make_tiny
from mtp_models import make_mimo

from mlxinfer import generate, load
from mlxinfer.errors import DraftError
from mlxinfer.generation.mtp_drafts import MTP
from mlxinfer.server.app import make_app

NAME = "mimo-tiny"
MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    path, _, _ = make_mimo(tmp_path_factory.mktemp("server-mtp") / "m", vocab_size=320)
    add_tokenizer(path)
    return load(str(path))


def test_chat_completion_with_mtp_equals_plain(mimo):
    from fastapi.testclient import TestClient

    model, tokenizer = mimo
    app = make_app(model, tokenizer, NAME, draft=MTP())
    with TestClient(app) as client:
        body = {"model": NAME, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        engine = app.state.models.entries[NAME].engine
        assert engine.counters.draft_tokens > 0  # it drafted
        # /metrics: per-position acceptance, tokens per step, draft and verify seconds.
        m, n = engine.metrics(), engine.counters
        metrics = client.get("/metrics").text
        label = f'model="{NAME}"'
        assert m["draft_row_steps"] > 0 and m["verify_seconds"] > 0 and m["draft_seconds"] > 0
        steps = m["draft_row_steps"]
        assert m["draft_tokens_per_step"] == (m["draft_accepted_tokens"] + steps) / steps
        assert f"mlxinfer_draft_row_steps_total{{{label}}} {steps:g}" in metrics
        assert f"mlxinfer_draft_tokens_per_step{{{label}}} " in metrics
        assert f"mlxinfer_verify_seconds_total{{{label}}} " in metrics
        assert "# TYPE mlxinfer_draft_position_accepted_tokens_total counter" in metrics
        first = n.draft_by_position[0], n.accepted_by_position[0]
        assert first[0] > 0 and sum(n.draft_by_position) == n.draft_tokens
        assert sum(n.accepted_by_position) == n.accepted_tokens
        assert f'mlxinfer_draft_position_tokens_total{{{label},position="1"}} {first[0]}' in metrics
        assert (
            f'mlxinfer_draft_position_accepted_tokens_total{{{label},position="1"}} {first[1]}'
            in metrics
        )
    assert text == generate(model, tokenizer, MESSAGES, max_tokens=12)


def test_a_model_without_heads_is_refused_at_start(tmp_path):
    path, _ = make_tiny(tmp_path / "qwen2", "qwen2", vocab_size=320)
    add_tokenizer(path)
    model, tokenizer = load(str(path))
    with pytest.raises(DraftError, match="has no MTP heads"):
        make_app(model, tokenizer, "plain", draft=MTP())
