"""What the compiled kernels (csrc/) buy in a whole decode step, before any wiring.

    python tools/build_kernels.py && python tools/bench_kernels_decode.py [--bits 4] [-n 64]

Loads SmolLM2-135M-Instruct (the transformers checkpoint the test fixtures build, see
tests/fixtures.py) with mlx-lm — a reference peer, used here only as a plain MLX model
graph without mlxinfer's CPU backend — quantizes it (or keeps f32 with --bits 32), and
times greedy decode with MLX's own products, then with nn.QuantizedLinear /
QuantizedEmbedding.as_linear (or nn.Linear / Embedding.as_linear for f32) patched to call
the kernels for up to 16 rows. Prints decode tok/s of each, the ratio and whether the
greedy tokens agree.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("MLXINFER_KERNELS_DIR", str(ROOT / "build" / "kernels")))
sys.path.insert(0, str(ROOT / "tests" / "support"))

import mlx.core as mx
import mlx.nn as nn

try:
    import _mlxinfer_kernels as K
except ImportError as e:
    sys.exit(f"bench_kernels_decode: {e} (build with python tools/build_kernels.py)")

MAX_ROWS = 16


def rows(x: mx.array) -> int:
    return x.size // x.shape[-1]


def patch(on: bool) -> None:
    """Route few-row products through the kernels (on) or restore MLX's (off)."""
    if not hasattr(patch, "orig"):
        patch.orig = (
            nn.QuantizedLinear.__call__,
            nn.QuantizedEmbedding.as_linear,
            nn.Linear.__call__,
            nn.Embedding.as_linear,
        )
    if not on:
        (
            nn.QuantizedLinear.__call__,
            nn.QuantizedEmbedding.as_linear,
            nn.Linear.__call__,
            nn.Embedding.as_linear,
        ) = patch.orig
        return
    q_call, q_head, f_call, f_head = patch.orig

    def q_product(self, x):
        return K.quantized_matvec(
            x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits
        )

    def quantized_call(self, x):
        if rows(x) > MAX_ROWS or self.mode != "affine":
            return q_call(self, x)
        y = q_product(self, x)
        return y + self["bias"] if "bias" in self else y

    def quantized_head(self, x):
        return q_head(self, x) if rows(x) > MAX_ROWS else q_product(self, x)

    def linear_call(self, x):
        if rows(x) > MAX_ROWS or self.weight.dtype != mx.float32:
            return f_call(self, x)
        y = K.matvec(x, self.weight)
        return y + self.bias if "bias" in self else y

    def linear_head(self, x):
        return f_head(self, x) if rows(x) > MAX_ROWS else K.matvec(x, self.weight)

    nn.QuantizedLinear.__call__ = quantized_call
    nn.QuantizedEmbedding.as_linear = quantized_head
    nn.Linear.__call__ = linear_call
    nn.Embedding.as_linear = linear_head


def decode(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    tok = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(tok)
    out = [tok.item()]
    t0 = time.perf_counter()
    for _ in range(n):
        logits = model(tok[:, None], cache=cache)
        tok = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(tok)
        out.append(tok.item())
    return n / (time.perf_counter() - t0), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=4, help="4, 8, or 32 (f32, not quantized)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("-n", type=int, default=64, help="decode steps per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: usable CPUs)")
    args = ap.parse_args()

    import fixtures
    from mlx_lm import load

    model, _ = load(str(fixtures.smollm2_hf_dir()))
    if args.bits != 32:
        nn.quantize(model, group_size=args.group_size, bits=args.bits)
    mx.eval(model.parameters())
    K.set_num_threads(args.threads)
    prompt = [int(t) for t in mx.random.randint(100, 40000, (32,), key=mx.random.key(0))]
    print(
        f"SmolLM2-135M {'f32' if args.bits == 32 else f'q{args.bits} g{args.group_size}'}; "
        f"kernel ISA {K.isa()}, {K.num_threads()} threads; load average "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )
    speeds = {False: [], True: []}
    tokens = {}
    decode(model, prompt, 4)  # warm-up
    for _ in range(args.reps):
        for on in (False, True):  # interleaved, so the load drifts evenly over both
            patch(on)
            tps, toks = decode(model, prompt, args.n)
            speeds[on].append(tps)
            tokens[on] = toks
    patch(False)
    base, kern = statistics.median(speeds[False]), statistics.median(speeds[True])
    same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
    print(f"MLX ops: {base:.1f} tok/s  kernels: {kern:.1f} tok/s  ratio {kern / base:.2f}×")
    print(f"greedy tokens agreeing: {same}/{len(tokens[False])}")
    print(f"load average at end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
