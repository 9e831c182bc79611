"""llama.cpp, mlxinfer and mlx-lm side by side on one GGUF, in one run, interleaved.

Each round runs, alternating which goes first:

- llama.cpp through llama-cpp-python, in its own virtual environment's Python (a child
  process; mlxinfer never imports it), with ``--threads`` threads for both prompt and
  decode, on the GGUF itself: one warm-up, then ``--reps`` runs of a P-token prompt
  (one batch) and N greedy tokens, one ``eval`` of one token at a time;
- ``python -m mlxinfer bench --compare mlx-lm`` on the same GGUF: on mlxinfer's import of it
  (exact values; the directory ``bench -m FILE.gguf`` loads), as mlx-lm cannot read a .gguf
  (and ``bench -m FILE.gguf --compare mlx-lm`` fails); ``-m FILE.gguf`` with ``--no-compare``.

The prompt is the bench's: P seeded random token ids (``mlxinfer.bench.prompt_ids``).
Definitions are the bench's for all three engines: prefill tok/s = P / time to first token,
decode tok/s = N / (time from the first token to the last). For llama.cpp both are timed in
the child around the ``eval`` calls (greedy argmax of the last logits included, as the
bench's include sampling); llama.cpp's own ``llama_perf_context`` figures
(n_p_eval / t_p_eval, n_eval / t_eval: per-step, without Python) are kept beside them.

The roofline fraction of each engine = bytes of weights read per decoded token x decode
tok/s / memory bandwidth, the bandwidth being the bench's probe (``measure_bandwidth``, the
best over the rounds: other work only lowers it). Bytes: for llama.cpp the GGUF's tensor
bytes (the token embedding counts one row when the file has a separate ``output.weight``,
else whole: it is the LM head); for mlxinfer and mlx-lm the loaded model's weight bytes
(``weight_bytes_per_token``, as the bench reports them; mlx-lm loads the same import). The
KV cache is left out.

When ``--threads`` is below the CPUs this process may use, every engine is pinned to that
many CPUs (mlxinfer's kernels use all the CPUs they may), so the thread counts match.

``--int8`` adds a third engine to every round (each engine first in turn): mlxinfer again with
``MLXINFER_INT8_ACTIVATIONS=1`` (x rounded to int8 per block of 32 in the tiled products, as
llama.cpp's own Q8 activations; docs/performance.md), without mlx-lm.

Other work on the machine skews every figure, llama.cpp's most: its threads spin at a barrier
after each op, so with 2 threads on 2 busy CPUs a decode step can take many times longer.
Each run records the load average before and after and the CPUs the other processes kept
busy meanwhile (/proc/stat less the run's own CPU time); ``--quiet-below L`` waits (up to
``--max-wait`` s) before each run for the 1-minute load average to fall to L.

Build llama-cpp-python from source in its own venv first:

    python3 -m venv /work/llama-venv
    CMAKE_BUILD_PARALLEL_LEVEL=2 /work/llama-venv/bin/pip install --no-binary \\
        llama-cpp-python llama-cpp-python

On a CPU that reports AMX but whose VM faults on it (segfault in the first decode), leave
AMX out: docs/performance.md ("llama.cpp side by side") gives the CMAKE_ARGS. A second build
with other CMAKE_ARGS (llama.cpp for AVX2 only: ``-DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_AVX512=OFF``) needs ``--no-cache-dir`` too: pip otherwise installs the wheel it built and
cached the first time, CMAKE_ARGS unread. The run's JSON keeps llama.cpp's own system info
(``info.llama.system_info``): an AVX2 build lists no AVX512.

Usage:

    python tools/bench_llamacpp.py --llama-python /work/llama-venv/bin/python \\
        --gguf ~/.cache/mlxinfer-tests/smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --rounds 3 -p 128 -n 64 --quiet-below 1.5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxinfer.bench import prompt_ids  # noqa: E402
from mlxinfer.gguf.container import read_gguf_header  # noqa: E402
from mlxinfer.loading.gguf_files import model_dir_for  # noqa: E402
from mlxinfer.platform.machine import cpu_name  # noqa: E402

DEFAULT_GGUF = "~/.cache/mlxinfer-tests/smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Runs in llama-cpp-python's venv: argv[1] is a JSON job, stdout gets one JSON line.
LLAMA_CHILD = r"""
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama

job = json.loads(sys.argv[1])
ids, n = job["ids"], job["tokens"]
t = time.perf_counter()
llm = Llama(model_path=job["gguf"], n_ctx=len(ids) + n + 16, n_batch=max(512, len(ids)),
            n_ubatch=max(512, len(ids)), n_threads=job["threads"],
            n_threads_batch=job["threads"], seed=0, verbose=False)
load_s = time.perf_counter() - t
vocab = llm.n_vocab()

def greedy():
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.ctypeslib.as_array(ptr, shape=(vocab,)).argmax())

def run():
    llm.reset()
    llama_cpp.llama_perf_context_reset(llm.ctx)
    out = []
    t0 = time.perf_counter()
    llm.eval(ids)
    out.append(greedy())
    t_first = time.perf_counter()
    while len(out) < n:
        llm.eval([out[-1]])
        out.append(greedy())
    t_last = time.perf_counter()
    perf = llama_cpp.llama_perf_context(llm.ctx)
    return {
        "ttft_s": t_first - t0,
        "prefill_tps": len(ids) / (t_first - t0),
        "decode_tps": n / (t_last - t_first),
        "perf": {k: getattr(perf, k) for k, _ in perf._fields_},
        "perf_prefill_tps": perf.n_p_eval / perf.t_p_eval_ms * 1e3,
        "perf_decode_tps": perf.n_eval / perf.t_eval_ms * 1e3,
        "tokens": out,
    }

run()  # warm-up
runs = [run() for _ in range(job["reps"])]
print(json.dumps({
    "version": llama_cpp.__version__,
    "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    "load_s": load_s,
    "runs": runs,
}))
"""


def gguf_bytes_per_token(path: Path) -> tuple[int, int]:
    """(bytes of the GGUF's tensors one decode step reads, all tensor bytes): every tensor,
    except a token embedding that is only gathered (a separate ``output.weight`` exists)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _, tensors = read_gguf_header(path, buf)
    total = sum(t.nbytes for t in tensors.values())
    emb = tensors.get("token_embd.weight")
    if emb is not None and "output.weight" in tensors:
        return total - emb.nbytes + emb.nbytes // emb.shape[0], total
    return total, total


def machine(res: dict) -> dict:
    return {k: res[k] for k in ("load", "others_cpus", "waited_s")}


def pinned(threads: int):
    """A preexec_fn pinning the child to ``threads`` CPUs, or None when it may use no more."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads >= len(cpus):
        return None
    return lambda: os.sched_setaffinity(0, cpus[:threads])


def busy_cpu_s() -> float:
    """CPU seconds every process on the machine has used since boot (/proc/stat)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_child(args, cmd: list[str], env: dict | None = None) -> tuple[str, dict]:
    """Run ``cmd`` (pinned to ``--threads`` CPUs), after waiting up to ``--max-wait`` seconds
    for the 1-minute load average to fall to ``--quiet-below``. Returns its stdout and what the
    machine was doing: the load average before and after, and the CPUs the other processes
    kept busy meanwhile (the machine's busy CPU time less the child's, over the wall time)."""
    waited, start = 0.0, time.time()
    while args.quiet_below is not None and os.getloadavg()[0] > args.quiet_below:
        if time.time() - start > args.max_wait:
            break
        time.sleep(5)
    waited = time.time() - start
    load = os.getloadavg()[0]
    busy, mine, t = busy_cpu_s(), children_cpu_s(), time.time()
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, preexec_fn=pinned(args.threads)
    )
    wall = time.time() - t
    others = (busy_cpu_s() - busy - (children_cpu_s() - mine)) / wall
    if done.returncode:
        tail = done.stderr[-3000:]
        raise SystemExit(f"{cmd[0]} {cmd[1]} … failed ({done.returncode}):\n{tail}")
    machine = {
        "load": (load, os.getloadavg()[0]),
        "others_cpus": max(others, 0.0),
        "waited_s": waited,
        "wall_s": wall,
    }
    return done.stdout + "\n" + done.stderr, machine


def run_llama(args, ids: list[int]) -> dict:
    job = {
        "gguf": str(args.gguf),
        "ids": ids,
        "tokens": args.tokens,
        "threads": args.threads,
        "reps": args.reps,
    }
    out, machine = run_child(args, [str(args.llama_python), "-c", LLAMA_CHILD, json.dumps(job)])
    line = next(ln for ln in reversed(out.splitlines()) if ln.startswith('{"version"'))
    return {**json.loads(line), **machine}


def run_mlxinfer(args, model: Path, out: Path, int8: bool = False) -> dict:
    """``mlxinfer bench`` in a child; ``int8``: with MLXINFER_INT8_ACTIVATIONS=1 (no mlx-lm)."""
    cmd = [sys.executable, "-m", "mlxinfer", "bench", "-m", str(model)]
    cmd += ["-p", str(args.prompt), "-n", str(args.tokens), "--reps", str(args.reps)]
    cmd += ["--json", str(out)] + (["--compare", "mlx-lm"] if args.compare and not int8 else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT), MLXINFER_INT8_ACTIVATIONS="1" if int8 else "0")
    text, machine = run_child(args, cmd, env)
    result = {**json.loads(out.read_text()), **machine}
    result["kernels"] = [ln.strip() for ln in text.splitlines() if "kernels:" in ln]
    return result


INT8 = "mlxinfer int8"  # --int8's engine: MLXINFER_INT8_ACTIVATIONS=1


def _round_line(r: int, engine: str, d: dict, res: dict) -> str:
    return (
        f"| {r + 1} | {engine} | {d['decode_tps']:.1f} | {d['prefill_tps']:.1f} "
        f"| {res['load'][0]:.2f} -> {res['load'][1]:.2f} | {res['others_cpus']:.2f} "
        f"| {res['waited_s']:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=Path(DEFAULT_GGUF))
    parser.add_argument("--llama-python", type=Path, default=Path("/work/llama-venv/bin/python"))
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="llama.cpp's threads; the CPUs every engine may use (default: all this may use)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-p", "--prompt", type=int, default=128)
    parser.add_argument("-n", "--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=1, help="timed runs per engine per round")
    parser.add_argument("--no-compare", dest="compare", action="store_false", help="no mlx-lm")
    parser.add_argument(
        "--int8",
        action="store_true",
        help="a third engine in every round: mlxinfer with MLXINFER_INT8_ACTIVATIONS=1",
    )
    parser.add_argument("--json", type=Path, help="write every run here")
    parser.add_argument(
        "--quiet-below",
        type=float,
        help="before each run, wait for the 1-minute load average to fall to this",
    )
    parser.add_argument("--max-wait", type=float, default=600, help="seconds, per run")
    args = parser.parse_args()
    args.gguf = args.gguf.expanduser().resolve()
    if args.tokens < 2 or args.prompt < 1 or args.threads < 1:
        parser.error("expected -n >= 2, -p >= 1, --threads >= 1")

    # mlx-lm cannot read a .gguf: it (and the bench with --compare) gets mlxinfer's import of it,
    # the very directory `mlxinfer bench -m FILE.gguf` loads.
    model_dir = model_dir_for(args.gguf, log=lambda m: print(m, file=sys.stderr))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ids = prompt_ids(args.prompt, vocab)
    gguf_read, gguf_total = gguf_bytes_per_token(args.gguf)
    mlxinfer_model = model_dir if args.compare else args.gguf

    runs: dict[str, list[dict]] = {"llama.cpp": [], "mlxinfer": [], "mlx-lm": []}
    engines = ["llama.cpp", "mlxinfer"]
    if args.int8:
        runs[INT8] = []
        engines.append(INT8)
    loads, others, per_round, bandwidths, weights, info = [], [], [], [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            # each engine first in turn (two: alternating)
            order = engines[r % len(engines) :] + engines[: r % len(engines)]
            for engine in order:
                if engine == "llama.cpp":
                    res = run_llama(args, ids)
                    info["llama"] = {k: res[k] for k in ("version", "system_info", "load_s")}
                    info.setdefault("llama_tokens", res["runs"][0]["tokens"][:16])
                    for x in res["runs"]:
                        x.pop("tokens")
                        runs["llama.cpp"].append({**x, **machine(res), "round": r + 1})
                    d = res["runs"][-1]
                else:
                    int8 = engine == INT8
                    res = run_mlxinfer(args, mlxinfer_model, Path(tmp) / "out.json", int8)
                    entry = res["results"][0]
                    if int8:
                        for x in entry["engines"]["mlxinfer"]["runs"]:
                            runs[INT8].append({**x, **machine(res), "round": r + 1})
                        info["kernels_int8"] = res["kernels"]
                        d = entry["engines"]["mlxinfer"]["median"]
                        loads += list(res["load"])
                        others.append(res["others_cpus"])
                        per_round.append(_round_line(r, engine, d, res))
                        print(per_round[-1], file=sys.stderr, flush=True)
                        continue
                    info["environment"], info["kernels"] = res["environment"], res["kernels"]
                    info["plans"] = res["engine"].get("cpu_plans")
                    weights["mlxinfer"] = entry["roofline"]["weight_bytes"]
                    bandwidths.append(res["bandwidth"]["gb_per_s"])
                    info["probe"] = res["bandwidth"]["probe"]
                    for name, e in entry["engines"].items():
                        for x in e["runs"]:
                            runs[name].append({**x, **machine(res), "round": r + 1})
                    d = entry["engines"]["mlxinfer"]["median"]
                loads += list(res["load"])
                others.append(res["others_cpus"])
                per_round.append(_round_line(r, engine, d, res))
                print(per_round[-1], file=sys.stderr, flush=True)

    bw = max(bandwidths)  # other work only ever lowers a probe
    weights["llama.cpp"] = gguf_read
    weights["mlx-lm"] = weights["mlxinfer"]  # mlx-lm loads the same import, same layout
    weights[INT8] = weights["mlxinfer"]
    env = info["environment"]
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{now}; CPU: {cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads for every "
        f"engine; MLX {env['mlx']}, llama-cpp-python {info['llama']['version']}"
        f"{', mlx-lm ' + str(env.get('mlx_lm')) if args.compare else ''}; bandwidth "
        f"{bw:.1f} GB/s (best of {len(bandwidths)} probes, one per mlxinfer run: "
        f"{', '.join(f'{b:.1f}' for b in bandwidths)}; {info['probe']}); load average "
        f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f}), other "
        f"processes kept {statistics.median(others):.2f} CPUs busy during the runs (median, "
        f"{min(others):.2f}-{max(others):.2f}); "
        f"{args.rounds} rounds x {args.reps} runs, p={args.prompt}, n={args.tokens}, medians\n"
        f"GGUF {args.gguf.name}: {gguf_total / 1e6:.1f} MB of tensors, {gguf_read / 1e6:.1f} MB "
        f"read per decoded token\nllama.cpp: {info['llama']['system_info']}\n"
        f"mlxinfer: {'; '.join(info['kernels'])}\n"
        + (f"mlxinfer int8: {'; '.join(info['kernels_int8'])}\n" if args.int8 else "")
    )
    print(
        "| engine | decode tok/s | (min-max) | prefill tok/s | weight MB/token "
        "| roofline fraction | decode vs llama.cpp | prefill vs llama.cpp |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ref = {
        m: statistics.median(x[m] for x in runs["llama.cpp"]) for m in ("decode_tps", "prefill_tps")
    }
    summary = {}
    for engine, rows in runs.items():
        if not rows:
            continue
        d = [x["decode_tps"] for x in rows]
        dm, pm = statistics.median(d), statistics.median(x["prefill_tps"] for x in rows)
        frac = weights[engine] * dm / (bw * 1e9)
        summary[engine] = {
            "decode_tps": dm,
            "decode_range": [min(d), max(d)],
            "prefill_tps": pm,
            "weight_bytes_per_token": weights[engine],
            "roofline_fraction": frac,
            "decode_vs_llama_cpp": dm / ref["decode_tps"],
            "prefill_vs_llama_cpp": pm / ref["prefill_tps"],
        }
        print(
            f"| {engine} | {dm:.1f} | {min(d):.1f}-{max(d):.1f} | {pm:.1f} "
            f"| {weights[engine] / 1e6:.1f} | {frac:.2f} | {dm / ref['decode_tps']:.2f}x "
            f"| {pm / ref['prefill_tps']:.2f}x |"
        )
    print(
        "\n| round | engine (in order) | decode tok/s | prefill tok/s | load before -> after "
        "| others' CPUs | waited s |\n|---|---|---|---|---|---|---|"
    )
    print("\n".join(per_round))
    own = runs["llama.cpp"]
    print(
        f"\nllama.cpp's own timings (llama_perf_context, per step, no Python): decode "
        f"{statistics.median(x['perf_decode_tps'] for x in own):.1f} tok/s, prefill "
        f"{statistics.median(x['perf_prefill_tps'] for x in own):.1f} tok/s; "
        f"its first greedy tokens: {info['llama_tokens']}"
    )
    if args.json:
        report = {
            "date": now,
            "cpu": cpu_name(),
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "gguf": str(args.gguf),
            "model_dir": str(model_dir),
            "settings": {
                k: getattr(args, k) for k in ("prompt", "tokens", "rounds", "reps", "int8")
            },
            "bandwidth_gb_s": bw,
            "bandwidths": bandwidths,
            "info": info,
            "summary": summary,
            "runs": runs,
        }
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
