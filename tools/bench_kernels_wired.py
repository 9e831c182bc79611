"""`mlxinfer bench` with the compiled kernels on and off (MLXINFER_KERNELS=0), and mlx-lm, interleaved.

Each round runs, per model, `python -m mlxinfer bench --json` once with the kernels (and
`--compare mlx-lm`) and once without them, alternating which goes first; the table gives
medians over the rounds (decode and prefill tok/s) and the load average around each run.
The plans are the ones `mlxinfer` measures and caches at load (the user cache), as a user
gets them. Usage:

    python tools/bench_kernels_wired.py q4=~/.cache/mlxinfer/models/SmolLM2-135M-Instruct \\
        f32=~/.cache/mlxinfer/models/SmolLM2-135M-Instruct-f32 --rounds 3 -p 128 -n 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def bench_once(model: Path, kernels: bool, args, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not kernels:
        env["MLXINFER_KERNELS"] = "0"
    cmd = [sys.executable, "-m", "mlxinfer", "bench", "-m", str(model)]
    cmd += ["-p", str(args.prompt), "-n", str(args.tokens), "--reps", str(args.reps)]
    cmd += ["--json", str(out)]
    if kernels and args.compare:
        cmd += ["--compare", "mlx-lm"]
    load = os.getloadavg()[0]
    start = time.time()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    result = json.loads(out.read_text())
    result["load"] = (load, os.getloadavg()[0])
    result["wall_s"] = time.time() - start
    result["stderr"] = done.stderr
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="NAME=PATH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-p", "--prompt", type=int, default=128)
    parser.add_argument("-n", "--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=1, help="bench --reps per run")
    parser.add_argument("--no-compare", dest="compare", action="store_false")
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args()
    models = [(m.split("=", 1)[0], Path(m.split("=", 1)[1]).expanduser()) for m in args.models]
    runs: dict[tuple[str, str], list[dict]] = {}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, path in models:
                order = (True, False) if r % 2 == 0 else (False, True)
                for kernels in order:
                    res = bench_once(path, kernels, args, Path(tmp) / "out.json")
                    entry = res["results"][0]
                    label = "kernels on" if kernels else "kernels off"
                    ours = entry["engines"]["mlxinfer"]["median"]
                    runs.setdefault((name, label), []).append(
                        {
                            **ours,
                            "plans": res["engine"].get("cpu_plans"),
                            "load": res["load"],
                            "bandwidth": res["bandwidth"],
                        }
                    )
                    if "mlx-lm" in entry["engines"]:
                        runs.setdefault((name, "mlx-lm"), []).append(
                            {**entry["engines"]["mlx-lm"]["median"], "load": res["load"]}
                        )
                    loads += list(res["load"])
                    for line in res["stderr"].splitlines():
                        if "CPU decode plans" in line:
                            print(f"{name} {label}: {line.strip()}", file=sys.stderr)
                    print(
                        f"round {r + 1} {name} {label}: decode {ours['decode_tps']:.1f} tok/s, "
                        f"prefill {ours['prefill_tps']:.1f} tok/s, load {res['load'][0]:.2f}"
                        f"->{res['load'][1]:.2f}, plans {res['engine'].get('cpu_plans')}",
                        file=sys.stderr,
                        flush=True,
                    )
    bw = next(iter(runs.values()))[0].get("bandwidth", {})
    print(
        f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; bandwidth probe "
        f"{bw.get('gb_per_s', float('nan')):.1f} GB/s ({bw.get('probe', '?')}); load average "
        f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f}); "
        f"{args.rounds} rounds, p={args.prompt}, n={args.tokens}, medians\n"
    )
    print("| model | engine | decode tok/s | (min-max) | prefill tok/s | decode vs mlx-lm |")
    print("|---|---|---|---|---|---|")
    for name, _ in models:
        peer = runs.get((name, "mlx-lm"))
        peer_decode = statistics.median(x["decode_tps"] for x in peer) if peer else None
        for label in ("kernels on", "kernels off", "mlx-lm"):
            rows = runs.get((name, label))
            if not rows:
                continue
            d = [x["decode_tps"] for x in rows]
            p = statistics.median(x["prefill_tps"] for x in rows)
            ratio = f"{statistics.median(d) / peer_decode:.2f}x" if peer_decode else "-"
            print(
                f"| {name} | {label} | {statistics.median(d):.1f} | {min(d):.1f}-{max(d):.1f} "
                f"| {p:.1f} | {ratio} |"
            )
    for (name, label), rows in runs.items():
        if label != "mlx-lm":
            print(f"\nplans {name} {label}: {rows[-1]['plans']}")
    if args.json:
        args.json.write_text(json.dumps({f"{k[0]}/{k[1]}": v for k, v in runs.items()}, indent=1))


if __name__ == "__main__":
    main()
