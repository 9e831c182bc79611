"""mlx-lm as the peer: its own benchmark in a child process (never imported), on the same BLAS."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from ..errors import MlxInferError
from ..platform.blas import preloaded_blas
from .common import BenchError, Run

# ---------------------------------------------------------------- mlx-lm (child process)


def require_mlx_lm() -> None:
    """Raise unless mlx-lm can be run; looked up without importing it."""
    if importlib.util.find_spec("mlx_lm") is None:
        raise MlxInferError("--compare mlx-lm: mlx-lm is not installed (pip install mlx-lm)")


_TRIAL = re.compile(r"^\s*Trial\s+\d+:\s*(.*)$", re.MULTILINE)


def parse_trials(output: str) -> list[dict[str, float]]:
    """The ``Trial N:  prompt_tps=…, generation_tps=…, peak_memory=…, total_time=…`` lines of
    ``mlx_lm.benchmark``'s output, as dicts (peak_memory in GB)."""
    trials = []
    for fields in _TRIAL.findall(output):
        trial = {}
        for item in fields.split(","):
            key, sep, value = item.strip().partition("=")
            if sep:
                try:
                    trial[key] = float(value)
                except ValueError:
                    pass
        if {"prompt_tps", "generation_tps", "peak_memory"} <= trial.keys():
            trials.append(trial)
    if not trials:
        tail = (
            " | ".join(line.strip() for line in output.strip().splitlines()[-5:]) or "(no output)"
        )
        raise BenchError(
            f"mlx_lm.benchmark printed no 'Trial N: prompt_tps=…' lines; its output ended: {tail}"
        )
    return trials


def mlx_lm_command(
    model_dir: Path,
    prompt_tokens: int,
    max_tokens: int,
    reps: int,
    prefill_step: int | None = None,
    batch_size: int = 1,
) -> list[str]:
    step = ["--prefill-step-size", str(prefill_step)] if prefill_step else []
    if batch_size > 1:  # mlx-lm's batch_generate over batch_size prompts
        step += ["--batch-size", str(batch_size)]
    return [
        sys.executable,
        "-m",
        "mlx_lm.benchmark",
        "--model",
        str(model_dir),
        "-p",
        str(prompt_tokens),
        "-g",
        str(max_tokens),
        "-n",
        str(reps),
        *step,
    ]


def child_env() -> dict[str, str]:
    """This process's environment, plus ``LD_PRELOAD`` of the BLAS we preloaded (same BLAS for both)."""
    env = dict(os.environ)
    blas = preloaded_blas()
    if blas:
        env["LD_PRELOAD"] = ":".join(p for p in (blas, env.get("LD_PRELOAD")) if p)
    return env


def run_mlx_lm(
    model_dir: Path,
    prompt_tokens: int,
    max_tokens: int,
    reps: int,
    prefill_step: int | None = None,
    batch_size: int = 1,
) -> list[Run]:
    """mlx-lm's own benchmark (its own warm-up, then ``reps`` trials) in a child process;
    with ``batch_size`` > 1, its ``batch_generate`` (rates are the batch's aggregate)."""
    proc = subprocess.run(
        mlx_lm_command(model_dir, prompt_tokens, max_tokens, reps, prefill_step, batch_size),
        env=child_env(),
        check=False,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in proc.stdout.strip().splitlines()[-5:])
        raise BenchError(f"mlx_lm.benchmark exited with code {proc.returncode}: {tail}")
    runs = []
    for t in parse_trials(proc.stdout):
        ttft = prompt_tokens / t["prompt_tps"] if t["prompt_tps"] > 0 else float("nan")
        runs.append(
            Run(
                ttft_s=ttft,
                prefill_tps=t["prompt_tps"],
                decode_tps=t["generation_tps"],
                peak_memory_gb=t["peak_memory"],
                total_s=t.get("total_time", float("nan")),
            )
        )
    return runs
