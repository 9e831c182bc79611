"""The soak tool's short version: `serve` under mixed clients, hang-ups, hostile requests, slow
bodies and a burst, on the real SmolLM2 (tools/soak.py runs the long one)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real
ROOT = Path(__file__).resolve().parent.parent


def test_a_short_soak_serves_everything_refuses_the_hostile_and_drains(smollm2_mlx_dir, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "tools" / "soak.py"), "--model", str(smollm2_mlx_dir)]
    cmd += ["--minutes", "0.25", "--clients", "4", "--slow-clients", "1", "--burst", "12"]
    cmd += ["--server-arg=--body-timeout", "--server-arg=4", "--json", str(out), "--check"]
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
