"""One-row (decode) products at each affine width with the quantized kernel, alternated.

    python csrc/tests/bench_widths.py [--isa avx2] [--threads 1] [--group-size 64] [--rounds 5]

For SmolLM2-135M's gate/up (576->1536), down (1536->576) and head (576->49152) shapes, every
width 2/3/4/5/6/8 (and MLX's float modes mxfp4, nvfp4, mxfp8 at their group sizes 32, 16, 32) runs
once per round, in turn (so load drifts hit them alike); a width's
figure is its best round, each round the median of 3 batches of calls per mx.eval. Prints µs
per call, ns per weight, ns per byte streamed (packed codes + scales + biases) and both
against 4-bit, with the CPU's lscpu model name, CPU count and load average. A memory-bound
kernel would take time in proportion to the bytes (3-bit at ~3/4 of 4-bit's time); a
compute-bound one in proportion to the weights.
"""

import argparse
import os
import statistics
import subprocess
import time

import mlx.core as mx

from mlxinfer.backends import kernels

SHAPES = [(576, 1536), (1536, 576), (576, 49152)]
# The float modes: (bits, group size), uint8 scales, no biases.
FLOAT_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
BITS = [2, 3, 4, 5, 6, 8, *FLOAT_MODES]


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")]
    return names[0] if names else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="best")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    K = kernels.load()
    if K is None:
        raise SystemExit(f"bench_widths: {kernels.reason()}")
    K.set_max_isa(args.isa)
    K.set_num_threads(args.threads)
    gs = args.group_size
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"# {cpu_name()}, {os.cpu_count()} CPUs; kernel ISA {K.isa()}, {args.threads} thread(s);")
    print(f"# group size {gs}; mlx {mx.__version__}; load average at start {load}")
    print("| shape | bits | µs | ns/weight | ns/byte | time vs 4-bit | per byte vs 4-bit |")
    print("|---|---|---|---|---|---|---|")
    for k_in, n_out in SHAPES:
        mx.random.seed(0)
        w = mx.random.normal((n_out, k_in)) * 0.05
        x = mx.random.normal((1, k_in))
        q = {b: mx.quantize(w, group_size=gs, bits=b) for b in BITS if b not in FLOAT_MODES}
        q |= {m: (*mx.quantize(w, mode=m), None) for m in FLOAT_MODES}
        mx.eval(x, *[a for t in q.values() for a in t if a is not None])
        nbytes = {b: sum(a.nbytes for a in q[b] if a is not None) for b in BITS}
        calls = max(3, min(50, int(3e8 // nbytes[8])))
        best = {b: float("inf") for b in BITS}
        for _ in range(args.rounds):
            for b in BITS:
                wq, s, bias = q[b]

                def batch(n, x=x, wq=wq, s=s, bias=bias, b=b):
                    if b in FLOAT_MODES:
                        bits, g = FLOAT_MODES[b]
                        ys = [K.quantized_matvec(x, wq, s, None, g, bits, mode=b) for _ in range(n)]
                    else:
                        ys = [K.quantized_matvec(x, wq, s, bias, gs, b) for _ in range(n)]
                    mx.eval(ys)

                batch(2)  # warm-up
                samples = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    batch(calls)
                    samples.append((time.perf_counter() - t0) / calls)
                best[b] = min(best[b], statistics.median(samples))
        for b in BITS:
            t = best[b]
            per_byte = (t / nbytes[b]) / (best[4] / nbytes[4])
            print(
                f"| {k_in}->{n_out} | {b} | {t * 1e6:.1f} | {t * 1e9 / (k_in * n_out):.4f} | "
                f"{t * 1e9 / nbytes[b]:.4f} | {t / best[4]:.2f}× | {per_byte:.2f}× |",
                flush=True,
            )
    K.set_num_threads(0)
    print(f"# load average at end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
