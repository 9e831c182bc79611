"""Time the compiled kernels (csrc/) against MLX's own ops on SmolLM2-135M's shapes.

    python tools/build_kernels.py && python tools/bench_kernels.py [--rows 1 4] [--bits 4 8]
        [--modes mxfp4 nvfp4 mxfp8]

Per shape: microseconds per call and GB/s of weight bytes streamed (packed weights +
scales + biases, or the float matrix) for mx.quantized_matmul, the kernel at 1 and 2
threads (--modes: MLX's float modes too, mx.quantize's defaults: their scales are uint8
and there are no biases), x @ w.T and the float kernel (--float: f32, and bf16 / f16 weights with x in the
same dtype, as in a model loaded in that dtype: MLX's own half-precision product). Calls are timed in batches of --calls
independent products per mx.eval (so the per-eval overhead is spread), median of
--repeat. Prints a Markdown table with the CPU, cores and load average.
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("MLXINFER_KERNELS_DIR", str(ROOT / "build" / "kernels")))

import mlx.core as mx

try:
    import _mlxinfer_kernels as K
except ImportError as e:
    sys.exit(f"bench_kernels: {e} (build with python tools/build_kernels.py)")

# (name, K in, N out)
SHAPES = [
    ("gate/up 576->1536", 576, 1536),
    ("down 1536->576", 1536, 576),
    ("q/o 576->576", 576, 576),
    ("head 576->49152", 576, 49152),
]
FLOATS = {"f32": mx.float32, "bf16": mx.bfloat16, "f16": mx.float16}
MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}  # (bits, group size)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def time_call(fn, calls: int, repeat: int) -> float:
    """Median seconds per call of fn() over `repeat` batches of `calls` calls."""
    mx.eval([fn() for _ in range(2)])  # warm-up (allocations, pool threads)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--bits", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--modes", nargs="*", default=[], choices=list(MODES))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--isa", default="best", help="cap: scalar, avx2, avx512 (arm64: neon) or best")
    ap.add_argument("--float", nargs="*", default=["f32"], choices=list(FLOATS))
    ap.add_argument("--shapes", nargs="+", help="only these shapes (their first word: head, down…)")
    args = ap.parse_args()
    K.set_max_isa(args.isa)

    print(
        f"CPU: {cpu_name()}; {os.cpu_count()} CPUs ({K.available_cpus()} usable); "
        f"kernel ISA {K.isa()} (best {K.best_isa}); mlx {mx.__version__}; load average at start "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )
    head = ["shape", "rows", "kind", "MLX µs", "MLX GB/s"]
    for t in args.threads:
        head += [f"kernel {t}T µs", "GB/s", "speedup"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    gs = args.group_size
    for name, k_in, n_out in SHAPES:
        if args.shapes and name.split()[0] not in args.shapes:
            continue
        mx.random.seed(0)
        w = mx.random.normal((n_out, k_in)) * 0.05
        mx.eval(w)
        for m in args.rows:
            x = mx.random.normal((m, k_in))
            mx.eval(x)
            kinds = []
            for bits in args.bits:
                wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
                mx.eval(wq, s, b)
                nbytes = wq.nbytes + s.nbytes + b.nbytes
                kinds.append(
                    (
                        f"q{bits} g{gs}",
                        nbytes,
                        lambda x=x, wq=wq, s=s, b=b, bits=bits: mx.quantized_matmul(
                            x, wq, s, b, transpose=True, group_size=gs, bits=bits
                        ),
                        lambda x=x, wq=wq, s=s, b=b, bits=bits: K.quantized_matvec(
                            x, wq, s, b, gs, bits
                        ),
                    )
                )
            for mode in args.modes:
                bits, mgs = MODES[mode]
                wq, s = mx.quantize(w, mode=mode)
                mx.eval(wq, s)
                kinds.append(
                    (
                        mode,
                        wq.nbytes + s.nbytes,
                        lambda x=x, wq=wq, s=s, mode=mode: mx.quantized_matmul(
                            x, wq, s, None, transpose=True, mode=mode
                        ),
                        lambda x=x, wq=wq, s=s, mode=mode, bits=bits, mgs=mgs: K.quantized_matvec(
                            x, wq, s, None, mgs, bits, mode=mode
                        ),
                    )
                )
            for kind in args.float:
                wf, xf = w.astype(FLOATS[kind]), x.astype(FLOATS[kind])
                mx.eval(wf, xf)
                kinds.append(
                    (
                        kind,
                        wf.nbytes,
                        lambda x=xf, w=wf: x @ w.T,
                        lambda x=xf, w=wf: K.matvec(x, w),
                    )
                )
            for kind, nbytes, ref_fn, ker_fn in kinds:
                calls = max(2, min(args.calls, int(2e8 // nbytes)))
                t_ref = time_call(ref_fn, calls, args.repeat)
                row = [name, str(m), kind, f"{t_ref * 1e6:.0f}", f"{nbytes / t_ref / 1e9:.2f}"]
                for t in args.threads:
                    K.set_num_threads(t)
                    t_k = time_call(ker_fn, calls, args.repeat)
                    row += [f"{t_k * 1e6:.0f}", f"{nbytes / t_k / 1e9:.2f}", f"{t_ref / t_k:.1f}×"]
                print("| " + " | ".join(row) + " |", flush=True)
    K.set_num_threads(0)
    print(f"load average at end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
