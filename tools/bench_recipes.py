"""Decode and prefill speed of quantization recipes against a baseline, in one process.

    python tools/bench_recipes.py BASELINE_DIR OTHER_DIR [...] [-n 64] [-p 128] [--rounds 5]

Issue 48 asks that a mixed-precision model decode within 10 % of uniform 4-bit at the same
bytes. Every model is loaded once (mlxinfer's loader: the CPU backend's kernels and plans
as `generate` uses them); then each round times one greedy generation of exactly ``-n``
tokens after a ``-p``-token prompt for every model in turn, so a busy machine slows every
model of a round alike. Prints per model the bytes of its weight files, the medians of
decode and prefill tok/s over the rounds, and their ratios to the first model's; ``--json``
keeps every run. The CPU and a bandwidth probe are printed first.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "models", nargs="+", type=Path, help="model directories; the first is the baseline"
    )
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from mlxinfer.platform.blas import preload_openblas

    preload_openblas()  # before mlx is imported, as the CLI does
    from mlxinfer.bench.bandwidth import measure_bandwidth
    from mlxinfer.bench.runs import prompt_ids, time_run
    from mlxinfer.loading.loader import load

    gbps, how = measure_bandwidth()
    print(
        f"CPU: {cpu_name()}, {len(__import__('os').sched_getaffinity(0))} cores; "
        f"bandwidth probe {gbps:.1f} GB/s ({how})",
        flush=True,
    )
    loaded = []
    for d in a.models:
        model, _ = load(str(d))
        ids = prompt_ids(a.prompt_tokens, model.args.vocab_size)
        time_run(model, ids, a.max_tokens, None)  # warm-up: plans, first-call compilation
        size = sum(f.stat().st_size for f in d.glob("model*.safetensors"))
        loaded.append((d, model, ids, size))
    runs: dict[str, list[dict]] = {str(d): [] for d in a.models}
    for r in range(a.rounds):
        for d, model, ids, _ in loaded:
            run, _, _ = time_run(model, ids, a.max_tokens, None)
            runs[str(d)].append({"decode_tps": run.decode_tps, "prefill_tps": run.prefill_tps})
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for d, _, _, size in loaded:
        rs = runs[str(d)]
        rows.append(
            {
                "model": str(d),
                "bytes": size,
                "decode_tps": statistics.median(x["decode_tps"] for x in rs),
                "prefill_tps": statistics.median(x["prefill_tps"] for x in rs),
            }
        )
    base = rows[0]
    print(f"| model | MB | decode tok/s | × {Path(base['model']).name} | prefill tok/s | × |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        row["decode_ratio"] = row["decode_tps"] / base["decode_tps"]
        row["prefill_ratio"] = row["prefill_tps"] / base["prefill_tps"]
        print(
            f"| {Path(row['model']).name} | {row['bytes'] / 1e6:.1f} | {row['decode_tps']:.1f} | "
            f"{row['decode_ratio']:.2f} | {row['prefill_tps']:.1f} | {row['prefill_ratio']:.2f} |"
        )
    if a.json:
        a.json.write_text(
            json.dumps(
                {"cpu": cpu_name(), "bandwidth_gbps": gbps, "rows": rows, "runs": runs}, indent=1
            )
        )


if __name__ == "__main__":
    main()
