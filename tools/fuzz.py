"""The suite's fuzz targets with a long budget: every parser fed hostile input for longer than CI can.

    python tools/fuzz.py [--examples 5000] [--random] [-k EXPR] [--minutes 60]

Runs ``tests/test_fuzz_*.py`` (the GGUF header reader, safetensors checks + load in a
subprocess with an address-space limit, config -> model build, tokenizer files, chat templates
under their time limit, the detokenizer, both APIs' request parsers) with
``MLXINFER_FUZZ_EXAMPLES`` examples per target instead of the suite's small budget.
``--random`` draws new examples (the suite's are derandomized, the same on every run).
Prints pytest's summary and hypothesis' per-target statistics; exits with pytest's code.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=5000, help="examples per fuzz target")
    ap.add_argument("--random", action="store_true", help="new random examples, not the fixed ones")
    ap.add_argument("-k", default=None, help="only the targets pytest's -k selects")
    ap.add_argument("--minutes", type=float, default=120.0, help="stop the whole run after this")
    args = ap.parse_args(argv)
    env = {**os.environ, "MLXINFER_FUZZ_EXAMPLES": str(args.examples)}
    if args.random:
        env["MLXINFER_FUZZ_RANDOM"] = "1"
    targets = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_fuzz_*.py"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["--hypothesis-show-statistics", *targets] + (["-k", args.k] if args.k else [])
    print(f"fuzz: {len(targets)} files, {args.examples} examples a target", flush=True)
    start = time.monotonic()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.minutes * 60).returncode
    except subprocess.TimeoutExpired:
        print(f"fuzz: stopped after {args.minutes} minutes")
        return 1
    print(f"fuzz: exit {rc} after {time.monotonic() - start:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
