"""What int8 activations cost in quality: `mlxinfer perplexity`'s protocol on one model, the
default products (x in int16) as the reference and MLXINFER_INT8_ACTIVATIONS's as the model
scored, in one process on the same tokens; with ``--gguf`` llama.cpp's perplexity on those tokens
too (its own Q8 activations, f16 KV cache), beside them.

    python tools/int8_quality.py MODEL_DIR [--chunks 16] [--ctx 512] \\
        [--gguf FILE.gguf --llama-python LLAMA_VENV/bin/python]

MODEL_DIR: an mlxinfer model (for a GGUF, the directory ``mlxinfer bench -m FILE.gguf`` imports
it to, ``mlxinfer.bench.model_dir_for``). The int8 products run only where the kernels have them
(AVX-512 VNNI: ``tiles_int8_available``) and on tiled layers, so the decode plans are forced to
tile every layer (``int16_decode=int16``) and a chunk's rows go through the tiles
(``int16_rows=1``): the reference and the scored model differ only in x's rounding. llama.cpp
runs in its own virtual environment's Python (llama-cpp-python built from source; see
tools/bench_llamacpp.py), ``logits_all``, each chunk from scratch, the second half scored.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import mlxinfer  # noqa: F401
import numpy as np

from mlxinfer.backends import kernels
from mlxinfer.backends.cpu import plans as cpu_plans
from mlxinfer.quality import perplexity as ppl

LLAMA_CHILD = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
job = json.loads(sys.argv[1])
chunks = json.load(open(job["chunks"]))
llm = Llama(model_path=job["gguf"], n_ctx=job["ctx"], n_batch=job["ctx"], n_threads=job["threads"],
            logits_all=True, verbose=False)
nll = []
for c in chunks:
    llm.reset()
    llm.eval(c)
    s = np.array(llm.scores[: len(c)], np.float64)
    first = len(c) // 2
    lg = s[first:-1]
    top = lg.max(-1, keepdims=True)
    lp = lg - (np.log(np.exp(lg - top).sum(-1, keepdims=True)) + top)
    t = np.array(c[first + 1 :])
    nll += (-lp[np.arange(len(t)), t]).tolist()
print(json.dumps({"nll": nll}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--gguf", type=Path, help="llama.cpp's perplexity on the same tokens")
    ap.add_argument("--llama-python", type=Path, default=Path("/work/llama-venv/bin/python"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    k = kernels.load()
    if k is None or not k.tiles_int8_available():
        raise SystemExit("int8 activations need the kernels' 512-bit tiles with AVX-512 VNNI")

    # Both models get the forced plans; the model scored second runs with int8 activations.
    models: dict[int, int] = {}
    chunks: list[list[int]] = []
    score = ppl._Model.score
    opened = ppl._Model.open

    def open_forced(cls, spec, log):
        m = opened.__func__(cls, spec, log)
        plans = {**cpu_plans.forced_plans("kernels"), "int16_decode": "int16", "int16_rows": 1}
        cpu_plans.set_plans(m.model, plans)
        return m

    def score_with(self, chunk, *a, **kw):
        which = models.setdefault(id(self), len(models))
        if which == 0:
            chunks.append(list(chunk))
        k.set_int8_activations(which == 1)
        try:
            return score(self, chunk, *a, **kw)
        finally:
            k.set_int8_activations(False)

    ppl._Model.open = classmethod(open_forced)  # type: ignore[method-assign, assignment]
    ppl._Model.score = score_with  # type: ignore[method-assign]
    report = ppl.perplexity([args.model], reference=args.model, ctx=args.ctx, chunks=args.chunks)
    ref, m = report.reference, report.models[0]
    out = {
        "cpu": kernels.describe(),
        "tokens": m.tokens,
        "ppl_int16": ref.ppl,
        "ppl_int8": m.ppl,
        "delta_ppl_pct": m.delta_ppl_pct,
        "kld": m.kld,
        "kld_p99": m.kld_p99,
        "kld_max": m.kld_max,
        "top1_pct": m.top1_pct,
        "rms_dp_pct": m.rms_dp_pct,
    }
    print(
        f"{args.model.name}, {m.tokens} tokens ({report.chunks} chunks of {args.ctx}): perplexity "
        f"int16 {ref.ppl:.4f}, int8 {m.ppl:.4f} ({m.delta_ppl_pct:+.2f} %); KLD {m.kld:.5f} "
        f"(p99 {m.kld_p99:.4f}, max {m.kld_max:.3f}); top-1 {m.top1_pct:.2f} %; "
        f"RMS dp {m.rms_dp_pct:.2f} %"
    )
    if args.gguf is not None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "chunks.json"
            path.write_text(json.dumps(chunks))
            job = {
                "gguf": str(args.gguf),
                "chunks": str(path),
                "ctx": args.ctx,
                "threads": len(os.sched_getaffinity(0)),
            }
            done = subprocess.run(
                [str(args.llama_python), "-c", LLAMA_CHILD, json.dumps(job)],
                capture_output=True,
                text=True,
            )
        if done.returncode:
            raise SystemExit(f"llama.cpp failed ({done.returncode}):\n{done.stderr[-3000:]}")
        nll = np.array(json.loads(done.stdout.strip().splitlines()[-1])["nll"])
        llama = math.exp(nll.mean())
        out["ppl_llama_cpp"] = llama
        out["llama_delta_ppl_pct"] = (llama / ref.ppl - 1) * 100
        print(
            f"llama.cpp on the same tokens ({args.gguf.name}): perplexity {llama:.4f} "
            f"({out['llama_delta_ppl_pct']:+.2f} % against mlxinfer's int16)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
