"""MTP in the batching engine, a process's first engine and the one after it (#45).

One fresh process: a warm-up batch, the head attached (a load cost, not decoding's), then
plain, MTP (the first engine: it times the step costs), plain, MTP (the second: it starts
from them), each the eight prompts of ``tools/bench_mtp.py`` through ``batch_generate`` at
once, greedy, ``-n`` tokens each. Prints one JSON line: each run's wall time, the MTP
engines' ratios to the mean of the two plain runs (above 1: faster), whether every run gave
plain's tokens, the drafting steps of the first engine (batch size, rows' drafts, ms) and the
step costs it left (by batch size: verification ms by positions, draft ms a token, acceptance
by position, probe interval).

    python tools/bench_mtp_batch.py --model DIR --head HEAD.safetensors [-n 128]

To compare two checkouts, alternate fresh processes with ``PYTHONPATH`` set to each (the
kernels' module copied into the other's ``mlxinfer/backends/kernels``), as docs/batching.md's
figures were measured. No timing here is a test; the load average is printed with the run.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxinfer  # noqa: E402
from bench_mtp import EVAL_PROMPTS  # noqa: E402
from mlxinfer.batch import batch_generate, verification  # noqa: E402
from mlxinfer.generation import draft_length  # noqa: E402
from mlxinfer.generation.mtp_drafts import MTP  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="MLX model directory")
    ap.add_argument("--head", required=True, type=Path, help="a head from mlxinfer train-mtp")
    ap.add_argument("-n", type=int, default=128, help="new tokens per prompt")
    args = ap.parse_args()

    drafting: list[tuple[int, int, float]] = []  # (rows, drafted, seconds) of steps that drafted
    verify_rows, record = verification.Verification.verify_rows, draft_length.StepCosts.record
    seen = {"drafted": 0}

    def counted_record(self, k, draft_s, positions, verify_s):
        seen["drafted"] += k
        return record(self, k, draft_s, positions, verify_s)

    def counted_step(self, rows):
        before, t = seen["drafted"], time.perf_counter()
        verify_rows(self, rows)
        if seen["drafted"] > before:
            drafting.append((len(rows), seen["drafted"] - before, time.perf_counter() - t))

    draft_length.StepCosts.record = counted_record  # type: ignore[method-assign]
    verification.Verification.verify_rows = counted_step  # type: ignore[method-assign]

    model, tokenizer = mlxinfer.load(args.model)[:2]

    def run(mtp: bool) -> tuple[float, list[str]]:
        t = time.perf_counter()
        draft = MTP(head=args.head) if mtp else None
        texts = batch_generate(
            model, tokenizer, EVAL_PROMPTS, max_tokens=args.n, chat_template=True, draft=draft
        )
        return time.perf_counter() - t, texts

    batch_generate(model, tokenizer, EVAL_PROMPTS[:2], max_tokens=8, chat_template=True)
    MTP(head=args.head).check(model, None)
    run(False)
    plain1, reference = run(False)
    drafting.clear()
    first, first_texts = run(True)
    first_steps = list(drafting)
    tables = model.__dict__.get("_batch_step_costs") or {}
    costs = {
        rows: {
            "verify_ms": {n: round(v * 1e3, 1) for n, v in c.verify.items()},
            "draft_ms": None if c.draft is None else round(c.draft * 1e3, 2),
            "acceptance": [round(a / d, 3) for a, d in zip(c.accepted, c.decided) if d],
            "probe": c.probe,
        }
        for rows, c in tables.items()
    }
    plain2, _ = run(False)
    second, second_texts = run(True)
    plain = (plain1 + plain2) / 2
    report = {
        "load": os.getloadavg()[0],
        "plain_s": [round(plain1, 2), round(plain2, 2)],
        "first_mtp_s": round(first, 2),
        "second_mtp_s": round(second, 2),
        "first_x": round(plain / first, 3),
        "second_x": round(plain / second, 3),
        "same_tokens": first_texts == reference and second_texts == reference,
        "first_engine_drafting_steps": [(b, k, round(s * 1e3)) for b, k, s in first_steps],
        "costs_after_first": costs,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
