"""Side-by-side benchmark: mlxinfer vs mlx-lm on the same converted weights.

SmolLM2-135M-Instruct (the transformers checkpoint from tests/fixtures.py) is
converted by ``mlxinfer.loading.convert.convert`` — float32, and 4-bit (group 64,
float16 scales; float32 scales on MLX's CPU backend, see MODELS) — and each
directory is loaded by both engines, unchanged, in one process.

How it measures, identically for both engines:

- the same prompt token ids (seeded random ids: no chat template, no
  tokenizer in the timed path), greedy sampling, EOS ignored — each engine's
  own token generator (``mlxinfer.generation.generate_step``,
  ``mlx_lm.generate.generate_step``) yields exactly ``max_tokens`` tokens;
- one outer timer around each generator: time to first token (TTFT) = prefill
  of the whole prompt plus the first sampled token; prefill tok/s = N / TTFT;
  decode tok/s = (M - 1) / (time from first to last token received);
- peak memory: ``mx.get_peak_memory()`` after ``mx.reset_peak_memory()``,
  less the other engine's resident weights (see ``time_run``); process RSS is
  sampled after each run (both models share the process: not per engine);
- a warm-up run per engine, then ``reps`` runs interleaved A B A B …;
  medians are reported, with ratios mlxinfer / mlx-lm.

    python tools/bench_vs_mlx_lm.py                 # 512-token prompt, 128 new tokens, 3 reps
    python tools/bench_vs_mlx_lm.py --quick         # smoke run
    python tools/bench_vs_mlx_lm.py -p 1024 -n 256 --models 4bit --json out.json

mlx-lm is a reference peer: this tool may import it, ``mlxinfer`` never does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from mlxinfer.platform.blas import blas_in_use, preload_openblas  # noqa: E402

preload_openblas()  # before the first `import mlx`: MLX's CPU matmuls must bind to OpenBLAS

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

ENGINES = ("mlxinfer", "mlx-lm")
# --models name -> mlxinfer.loading.convert.convert options
MODELS = {
    "f32": dict(dtype="float32"),
    "4bit": dict(quantize=True, bits=4, group_size=64, dtype="float16"),
    # Same 4-bit weights with float32 scales and activations. MLX's CPU backend has
    # no fast float16 kernels: its float16 quantized matmul is ~30x slower than the
    # float32 one (a '4bit' decode step of SmolLM2-135M takes ~4 s on 2 cores).
    "4bit-f32": dict(quantize=True, bits=4, group_size=64, dtype="float32"),
}
# metric -> (label, unit scale, format, True when higher is better)
METRICS = {
    "prefill_tps": ("prefill", 1.0, "{:.0f} tok/s", True),
    "decode_tps": ("decode", 1.0, "{:.1f} tok/s", True),
    "ttft_s": ("time to first token", 1000.0, "{:.1f} ms", False),
    "peak_memory_gb": (
        "peak memory (MLX)",
        1000.0,
        "{:.0f} MB",
        False,
    ),  # own weights + the run's peak
}

TokenFn = Callable[[list[int], int], Iterator[int]]  # (prompt ids, max_tokens) -> token ids


def default_models() -> str:
    """f32 and 4-bit; on MLX's CPU backend the 4-bit model keeps float32 scales (see MODELS)."""
    return "f32,4bit-f32" if mx.default_device() == mx.cpu else "f32,4bit"


@dataclass
class Engine:
    name: str
    model: object
    tokens: TokenFn
    weight_bytes: int  # the model's parameters, counted in its peak memory


@dataclass
class Run:
    """One timed generation."""

    prefill_tps: float
    ttft_s: float
    decode_tps: float
    peak_memory_gb: float
    rss_gb: float
    tokens: list[int]


# ---------------------------------------------------------------- engines


def load_engines(model_dir: Path) -> dict[str, Engine]:
    """Both engines' models for ``model_dir``, each with its own greedy token generator."""
    import mlx_lm
    from mlx_lm.generate import (
        generate_step as mlx_lm_generate_step,  # the package re-binds `generate`
    )

    import mlxinfer
    from mlxinfer.generation import generate_step

    ours, _ = mlxinfer.load(model_dir)
    theirs, _ = mlx_lm.load(str(model_dir))
    for model in (ours, theirs):
        mx.eval(model.parameters())  # mlxinfer maps weights lazily; mlx-lm already evaluated them

    def mlxinfer_tokens(ids: list[int], max_tokens: int) -> Iterator[int]:
        return (t for t, _ in generate_step(ids, ours, max_tokens=max_tokens))

    def mlx_lm_tokens(ids: list[int], max_tokens: int) -> Iterator[int]:
        # Its default sampler is greedy; it never checks EOS (stream_generate does).
        return (t for t, _ in mlx_lm_generate_step(mx.array(ids), theirs, max_tokens=max_tokens))

    return {
        "mlxinfer": Engine("mlxinfer", ours, mlxinfer_tokens, _nbytes(ours)),
        "mlx-lm": Engine("mlx-lm", theirs, mlx_lm_tokens, _nbytes(theirs)),
    }


def _nbytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


# ---------------------------------------------------------------- timing


def _rss_gb() -> float:
    """Current resident set size (Linux), else the process's peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 1e9
    except OSError:
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


def time_run(engine: Engine, ids: list[int], max_tokens: int) -> Run:
    """Time one generation with the same outer timer whatever the engine.

    Both engines' weights are resident, so MLX's peak counter would charge each
    run for the other model too: the peak reported is this engine's weights
    plus the run's rise above the memory in use when it started.
    """
    gc.collect()
    mx.synchronize()
    mx.clear_cache()  # every run starts from an empty buffer cache, whoever ran before
    mx.reset_peak_memory()
    baseline = mx.get_active_memory()
    out: list[int] = []
    t0 = time.perf_counter()
    t_first = t_last = t0
    steps = engine.tokens(ids, max_tokens)
    for token in steps:
        t_last = time.perf_counter()  # `token` is a Python int: its step has finished
        if not out:
            t_first = t_last
        out.append(token)
    steps.close()
    # mlx-lm starts one step past the last token it yields; let it finish outside the timer.
    mx.synchronize()
    if len(out) != max_tokens:
        raise RuntimeError(f"expected {max_tokens} tokens, got {len(out)}")
    ttft = t_first - t0
    decode = (len(out) - 1) / (t_last - t_first) if len(out) > 1 and t_last > t_first else 0.0
    return Run(
        prefill_tps=len(ids) / ttft,
        ttft_s=ttft,
        decode_tps=decode,
        peak_memory_gb=(engine.weight_bytes + mx.get_peak_memory() - baseline) / 1e9,
        rss_gb=_rss_gb(),
        tokens=out,
    )


def prompt_ids(n: int, vocab_size: int, seed: int = 0) -> list[int]:
    """A fixed prompt of ``n`` token ids, the same for both engines."""
    import numpy as np

    return (
        np.random.default_rng(seed).integers(3, vocab_size, n).tolist()
    )  # past the usual specials


def measure(
    model_dir: str | Path,
    *,
    prompt_tokens: int = 512,
    max_tokens: int = 128,
    reps: int = 3,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Benchmark both engines on ``model_dir``: a warm-up each, then ``reps`` interleaved runs.

    Returns ``{"engines": {name: {"runs": [...], "median": {...}}}, "ratios": {...}, ...}``
    where each ratio is mlxinfer's median / mlx-lm's median.
    """
    if max_tokens < 2:
        raise ValueError("max_tokens must be at least 2 (decode speed needs two tokens)")
    log = log or (lambda _: None)
    engines = load_engines(Path(model_dir))
    ids = prompt_ids(prompt_tokens, engines["mlxinfer"].model.args.vocab_size)
    for name, engine in engines.items():
        log(f"  warm-up {name}")
        time_run(engine, ids, max_tokens)
    runs: dict[str, list[Run]] = {name: [] for name in ENGINES}
    for rep in range(reps):
        for name in ENGINES:  # interleaved: A B A B …
            run = time_run(engines[name], ids, max_tokens)
            runs[name].append(run)
            log(
                f"  rep {rep + 1}/{reps} {name:<8} prefill {run.prefill_tps:8.1f} tok/s  "
                f"decode {run.decode_tps:6.1f} tok/s  peak {run.peak_memory_gb * 1000:.0f} MB"
            )
    result: dict = {
        "model_dir": str(model_dir),
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "reps": reps,
        "engines": {},
    }
    for name, rs in runs.items():
        median = {m: statistics.median(getattr(r, m) for r in rs) for m in (*METRICS, "rss_gb")}
        result["engines"][name] = {
            "median": median,
            "runs": [{k: v for k, v in asdict(r).items() if k != "tokens"} for r in rs],
        }
    ours, theirs = (result["engines"][n]["median"] for n in ENGINES)
    result["ratios"] = {m: ours[m] / theirs[m] if theirs[m] else float("nan") for m in METRICS}
    # Same weights, greedy: the token streams should agree (a check that both did the same work).
    result["same_tokens"] = runs["mlxinfer"][0].tokens == runs["mlx-lm"][0].tokens
    del engines
    gc.collect()
    mx.clear_cache()
    return result


# ---------------------------------------------------------------- report


def environment() -> dict:
    import mlx_lm

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": str(mx.default_device()),
        "blas": blas_in_use(),
        "cpus": os.cpu_count(),
        "load_average_1min": load,
    }  # other work on the machine skews both engines


def markdown_table(results: dict[str, dict], env: dict) -> str:
    """One row per (model, metric): both engines' medians and mlxinfer / mlx-lm."""
    any_result = next(iter(results.values()))
    lines = [
        f"mlxinfer vs mlx-lm {env['mlx_lm']} — MLX {env['mlx']} on {env['device']}, {env['blas']}; "
        f"{any_result['prompt_tokens']}-token prompt, {any_result['max_tokens']} generated tokens, "
        f"greedy, median of {any_result['reps']} interleaved runs; {env['cpus']} CPUs, "
        f"1-min load average {env['load_average_1min']:.1f} at start.",
        "",
        "| model | metric | mlxinfer | mlx-lm | mlxinfer / mlx-lm |",
        "|---|---|---:|---:|---:|",
    ]
    for model, r in results.items():
        ours, theirs = (r["engines"][n]["median"] for n in ENGINES)
        for m, (label, scale, fmt, higher) in METRICS.items():
            arrow = "↑" if higher else "↓"
            lines.append(
                f"| {model} | {label} {arrow} | {fmt.format(ours[m] * scale)} | "
                f"{fmt.format(theirs[m] * scale)} | {r['ratios'][m]:.2f}× |"
            )
    rss = ", ".join(
        f"{m} {max(r['engines'][n]['median']['rss_gb'] for n in ENGINES) * 1000:.0f} MB"
        for m, r in results.items()
    )
    lines += [
        "",
        "↑ higher is better, ↓ lower is better. Peak memory: the engine's weights plus the run's "
        "rise in MLX memory (KV cache, activations). Process RSS (both models loaded, so not per "
        f"engine): {rss}.",
    ]
    mismatched = [m for m, r in results.items() if not r["same_tokens"]]
    if mismatched:
        lines.append(f"Note: greedy tokens differ between engines for {', '.join(mismatched)}.")
    return "\n".join(lines)


def benchmark(
    models: list[str],
    *,
    src: Path | None = None,
    prompt_tokens: int = 512,
    max_tokens: int = 128,
    reps: int = 3,
    log: Callable[[str], None] = print,
) -> dict[str, dict]:
    """Convert the reference checkpoint for each of ``models`` and measure both engines on it."""
    from mlxinfer.loading.convert import convert

    if src is None:
        from fixtures import smollm2_hf_dir

        log("reference checkpoint (built once, cached) …")
        src = smollm2_hf_dir()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-mlxinfer-") as work:
        for name in models:
            log(f"{name}: converting {src.name} …")
            out = Path(work) / name
            convert(src, out, **MODELS[name])
            log(f"{name}: measuring")
            results[name] = measure(
                out, prompt_tokens=prompt_tokens, max_tokens=max_tokens, reps=reps, log=log
            )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-p", "--prompt-tokens", type=int, default=None, help="prompt length (default 512)"
    )
    parser.add_argument(
        "-n", "--max-tokens", type=int, default=None, help="tokens to generate (default 128)"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed runs per engine (default 3)")
    parser.add_argument(
        "--models",
        default=None,
        help=f"comma-separated, from: {', '.join(MODELS)} "
        "(default: f32,4bit; f32,4bit-f32 on MLX's CPU backend)",
    )
    parser.add_argument(
        "--src",
        type=Path,
        default=None,
        help="an HF checkpoint directory to convert (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 64-token prompt, 16 tokens, 2 reps"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the full results here")
    args = parser.parse_args(argv)
    models = [m.strip() for m in (args.models or default_models()).split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        parser.error(
            f"--models: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}"
        )
    quick = dict(prompt_tokens=64, max_tokens=16, reps=2)
    full = dict(prompt_tokens=512, max_tokens=128, reps=3)
    sizes = {
        k: v if getattr(args, k) is None else getattr(args, k)
        for k, v in (quick if args.quick else full).items()
    }

    def log(msg: str) -> None:  # progress on stderr, the table alone on stdout
        print(msg, file=sys.stderr, flush=True)

    env = environment()
    results = benchmark(models, src=args.src, log=log, **sizes)
    print(markdown_table(results, env))
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "results": results}, indent=2))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
