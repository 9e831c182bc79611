"""The soak tool's short version: `serve` under mixed clients, hang-ups, hostile requests, slow
bodies and a burst. What it checks is the server's (every request answered or refused in shape,
the pool drained, /health answered, SIGTERM), not the model's, so it runs on a tiny random
checkpoint with a chat template (on the real SmolLM2 it cost ~100 s of the suite's then 15 minutes);
`python tools/soak.py --minutes 5 --check` runs the long one on SmolLM2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_chat_model(tmp_path):
    """A random llama with a byte-level BPE tokenizer and a ChatML template; a context long
    enough for the soak's long-prompt client (~3,900 tokens)."""
    from hf_models import add_tokenizer, make_tiny

    path = tmp_path / "tiny"
    path.mkdir()
    make_tiny(path, "llama", vocab_size=320, max_position_embeddings=8192)
    return add_tokenizer(path)


def test_a_short_soak_serves_everything_refuses_the_hostile_and_drains(tiny_chat_model, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "tools" / "soak.py"), "--model", str(tiny_chat_model)]
    cmd += ["--minutes", "0.12", "--clients", "4", "--slow-clients", "1", "--burst", "12"]
    cmd += ["--server-arg=--body-timeout", "--server-arg=3", "--json", str(out), "--check"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["failures"] == []
    assert r["errors_5xx"] == 0 and r["connection_failures"] == 0
    assert r["hostile"] > 0 and r["hostile_4xx_in_shape"] == r["hostile"]
    assert r["kv_blocks_in_use_drained"] == 0
    # every kind of well-behaved client was served at least once, the burst's streams included
    assert r["requests_served"].get("stream", 0) >= 12
    assert r["requests_served"].get("slow_body_refused", 0) == 1  # 408 after --body-timeout
    assert r["health_failures"] == 0
    assert r["sigterm_exit_s"] <= 10
