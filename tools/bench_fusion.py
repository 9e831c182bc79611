"""Does fusing Q/K/V or gate/up into one matmul pay off? Measured on a model's own shapes.

For each layer shape of the model (default: SmolLM2-135M f32, converted from
the reference checkpoint) this times, for a one-row input (a decode step) and
a many-row input (a prefill chunk):

- q, k, v projections as three matmuls vs one matmul over the stacked weights;
- gate and up projections as two matmuls vs one over the stacked weights.

Each variant runs over copies of the weights for every layer, so the weights
come from memory as in a real step, interleaved A B A B, and the median is
reported with fused / separate. Fusion is only worth adopting where the ratio
is clearly below 1.

    python tools/bench_fusion.py                   # SmolLM2-135M shapes
    python tools/bench_fusion.py --model DIR       # any converted model directory
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from mlxinfer.platform.blas import blas_in_use, preload_openblas  # noqa: E402

preload_openblas()

import mlx.core as mx  # noqa: E402


def shapes(model_dir: Path | None) -> dict:
    if model_dir is None:
        cfg = {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "num_hidden_layers": 30,
        }
    else:
        cfg = json.loads((model_dir / "config.json").read_text())
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or d // heads
    kv = cfg.get("num_key_value_heads") or heads
    return {
        "hidden": d,
        "q": heads * head_dim,
        "kv": kv * head_dim,
        "ffn": cfg["intermediate_size"],
        "layers": cfg["num_hidden_layers"],
    }


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - t)
    return out


def compare(
    name: str, parts: list[int], d: int, layers: int, rows: int, reps: int
) -> tuple[str, float, float]:
    separate = [[mx.random.normal((n, d)) for n in parts] for _ in range(layers)]
    fused = [mx.concatenate(ws, axis=0) for ws in separate]
    mx.eval(separate, fused)
    x = mx.random.normal((rows, d))

    def run_separate():
        return [x @ w.T for ws in separate for w in ws]

    def run_fused():
        return [x @ w.T for w in fused]

    run_separate(), run_fused()  # warm-up
    a, b = [], []
    for _ in range(reps):  # interleaved
        a += timed(run_separate, 1)
        b += timed(run_fused, 1)
    sep, fus = statistics.median(a) / layers, statistics.median(b) / layers
    return name, sep, fus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="converted model directory (its config.json)"
    )
    parser.add_argument("--rows", default="1,512", help="input rows to test (default: 1,512)")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    s = shapes(args.model)
    print(f"MLX {mx.__version__} on {mx.default_device()}, {blas_in_use()}; shapes {s}\n")
    print("| projection | rows | separate | fused | fused / separate |")
    print("|---|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        reps = args.reps if rows == 1 else max(3, args.reps // 5)
        for name, parts in (
            ("q, k, v", [s["q"], s["kv"], s["kv"]]),
            ("gate, up", [s["ffn"], s["ffn"]]),
        ):
            label, sep, fus = compare(name, parts, s["hidden"], s["layers"], rows, reps)
            print(
                f"| {label} | {rows} | {sep * 1e6:.0f} µs | {fus * 1e6:.0f} µs | {fus / sep:.2f}× |"
            )


if __name__ == "__main__":
    main()
