"""mlxinfer's rows of docs/quality.md: our plans at the peers' sizes, scored on the same tokens.

For one model (a GGUF file or a float directory) and its float32 reference directory:

1. ``mlxinfer convert SRC -o OUT/bpw4.5 -q --dtype float32`` — the default plan; its
   calibration pass and per-tensor costs are measured once and saved beside it
   (``imatrix.safetensors``, ``quantization-plan.json``);
2. for each ``--sizes`` entry, ``mlxinfer convert --max-bytes N --plan-from ... --imatrix ...``:
   the same measurements planned for another budget (no probe pass again);
3. each ``--recipes`` entry (``q4_k_m``, ``q3_k_m``);
4. ``mlxinfer perplexity -m ... --reference REF --json``: the shipped evaluation corpus (never
   the calibration one), 16 chunks of 512 tokens — the protocol the peers' rows used.

    python tools/quality_ours.py --source SmolLM2.Q4_1.gguf --reference /tmp/q/f32 \\
        --out /tmp/ours-smollm2 --sizes 67.5M,72.7M,84.3M,87.7M,103.7M --json docs/quality/x.json

Takes about five minutes for the first plan of a 135M model on 2 cores, then well under a
minute per size; the scoring about a minute per model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEAK_RSS = {}  # output name -> the convert process's peak resident memory, bytes


def run(args: list[str], name: str | None = None) -> str:
    """Run one command; with ``name``, record its peak resident memory (wait4's rusage is the
    child's own, Linux reports ru_maxrss in KiB)."""
    print("+", " ".join(args), file=sys.stderr, flush=True)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(args, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if child.returncode != 0:
        sys.exit(f"failed ({child.returncode}): {' '.join(args)}\n{stderr[-2000:]}")
    if name is not None:
        PEAK_RSS[name] = usage.ru_maxrss * 1024
    return stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", required=True, help="GGUF file or float model directory")
    ap.add_argument("--reference", required=True, help="float32 reference directory")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sizes", default="", help="comma-separated byte budgets (K/M/G suffixes)")
    ap.add_argument("--recipes", default="q4_k_m", help="comma-separated named recipes")
    ap.add_argument("--json", type=Path, help="write the perplexity report here")
    ap.add_argument("--chunks", default="16")
    a = ap.parse_args()

    cli = [sys.executable, "-m", "mlxinfer"]
    a.out.mkdir(parents=True, exist_ok=True)
    first = a.out / "bpw4.5"
    timings = {}
    if not first.exists():
        t = time.monotonic()
        run([*cli, "convert", a.source, "-o", str(first), "-q", "--dtype", "float32"], first.name)
        timings[first.name] = time.monotonic() - t
    outs = [first]
    saved = ["--plan-from", str(first / "quantization-plan.json")]
    saved += ["--imatrix", str(first / "imatrix.safetensors")]
    for size in filter(None, a.sizes.split(",")):
        out = a.out / f"bytes{size}"
        if not out.exists():
            t = time.monotonic()
            run(
                [
                    *cli,
                    "convert",
                    a.source,
                    "-o",
                    str(out),
                    "--max-bytes",
                    size,
                    "--dtype",
                    "float32",
                    *saved,
                ],
                out.name,
            )
            timings[out.name] = time.monotonic() - t
        outs.append(out)
    for recipe in filter(None, a.recipes.split(",")):
        out = a.out / recipe
        if not out.exists():
            t = time.monotonic()
            run(
                [
                    *cli,
                    "convert",
                    a.source,
                    "-o",
                    str(out),
                    "--recipe",
                    recipe,
                    "--dtype",
                    "float32",
                    "--imatrix",
                    str(first / "imatrix.safetensors"),
                ],
                out.name,
            )
            timings[out.name] = time.monotonic() - t
        outs.append(out)
    models = [x for o in outs for x in ("-m", str(o))]
    report = run(
        [*cli, "perplexity", *models, "--reference", a.reference, "--chunks", a.chunks, "--json"]
    )
    start = report.index("{")
    data = json.loads(report[start : report.rindex("}") + 1])
    data["convert_seconds"] = timings
    data["convert_peak_rss_bytes"] = PEAK_RSS
    for o in outs:
        plan = json.loads((o / "quantization-plan.json").read_text())
        data.setdefault("plans", {})[o.name] = {
            k: plan[k] for k in ("bytes", "budget", "predicted_kl", "measured_kl", "seconds")
        }
    text = json.dumps(data, indent=1)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
