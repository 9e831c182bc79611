"""HTTP serving under load: `mlxinfer serve` against `mlx_lm.server`, on the same weights.

    python tools/bench_server.py MODEL_DIR [--clients 1,4,8,16] [--max-tokens 64] [--rounds 1] [--json OUT]

Each server runs alone (started, measured, stopped; the two alternate per client count, on
the same BLAS: OpenBLAS is preloaded into mlx_lm.server as `mlxinfer bench` does). With
``--rounds N`` the whole sequence runs N times; the table gives the medians, and each
round's own ratio (the two servers measured one after the other) is printed too: on a VM
whose neighbours come and go, one round can be far from the next. For C
clients, C threads each send one streamed chat completion at once (greedy, distinct prompts,
`max_tokens`); a client's time to first token is until its first content chunk, and the
aggregate rate is the content chunks of all clients over the wall time from the first send
to the last chunk. mlx_lm.server runs with its defaults (decode concurrency 32).
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlxinfer  # noqa: F401  (the fast BLAS, for the environment passed to mlx_lm)
import httpx

from mlxinfer.bench import child_env
from mlxinfer.bench.bandwidth import environment

PROMPT = "Tell me a short story about the number {i}, in three sentences."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: str, model: Path, port: int) -> subprocess.Popen:
    if engine == "mlxinfer":
        cmd = [sys.executable, "-m", "mlxinfer", "serve", "-m", str(model), "--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/v1/models"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{engine} did not answer within 180 s")


def one(url: str, name: str, i: int, max_tokens: int, out: dict) -> None:
    body = {
        "model": name,
        "messages": [{"role": "user", "content": PROMPT.format(i=i)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    sent = time.perf_counter()
    first, chunks = None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                chunks += 1
                first = first or time.perf_counter()
    out[i] = {
        "sent": sent,
        "ttft": (first or time.perf_counter()) - sent,
        "chunks": chunks,
        "done": time.perf_counter(),
    }


def load(url: str, name: str, clients: int, max_tokens: int) -> dict:
    out: dict = {}
    threads = [
        threading.Thread(target=one, args=(url, name, i, max_tokens, out)) for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = min(r["sent"] for r in out.values())
    wall = max(r["done"] for r in out.values()) - start
    ttfts = sorted(r["ttft"] for r in out.values())
    chunks = sum(r["chunks"] for r in out.values())
    return {
        "clients": clients,
        "aggregate_tps": chunks / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "chunks": chunks,
        "wall_s": wall,
    }


def _row(rows: list[dict], engine: str, clients: int, rnd: int) -> dict:
    return next(
        r for r in rows if (r["engine"], r["clients"], r["round"]) == (engine, clients, rnd)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    names = {"mlxinfer": args.model.name, "mlx-lm": str(args.model)}
    rows = []
    for rnd, clients, engine in [
        (r, c, e) for r in range(args.rounds) for c in counts for e in ("mlxinfer", "mlx-lm")
    ]:
        port = free_port()
        proc = start(engine, args.model, port)
        try:
            url = f"http://127.0.0.1:{port}"
            load(url, names[engine], 1, 4)  # warm-up
            row = {
                "engine": engine,
                "round": rnd,
                **load(url, names[engine], clients, args.max_tokens),
            }
        finally:
            proc.terminate()
            proc.wait(30)
        rows.append(row)
        print(
            f"round {rnd + 1}: {engine:>8} {clients:>2} clients: {row['aggregate_tps']:6.1f} tok/s, "
            f"TTFT p50 {row['ttft_p50_s'] * 1000:6.0f} ms, p99 {row['ttft_p99_s'] * 1000:6.0f} ms",
            flush=True,
        )

    def median(engine: str, clients: int, key: str) -> float:
        return statistics.median(
            r[key] for r in rows if r["engine"] == engine and r["clients"] == clients
        )

    medians = {
        (e, c): {k: median(e, c, k) for k in ("aggregate_tps", "ttft_p50_s", "ttft_p99_s")}
        for e in ("mlxinfer", "mlx-lm")
        for c in counts
    }
    base = {e: medians[e, counts[0]]["aggregate_tps"] for e in ("mlxinfer", "mlx-lm")}
    if args.rounds > 1:
        for c in counts:
            per_round = [
                _row(rows, "mlxinfer", c, k)["aggregate_tps"]
                / _row(rows, "mlx-lm", c, k)["aggregate_tps"]
                for k in range(args.rounds)
            ]
            print(f"{c} clients, each round's ratio: " + ", ".join(f"{x:.2f}×" for x in per_round))
    print(
        "\n| clients | mlxinfer tok/s | × its 1 | mlx-lm tok/s | × its 1 | ratio | TTFT p50 / p99 (ours) | TTFT p50 / p99 (mlx-lm) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in counts:
        ours, theirs = medians["mlxinfer", c], medians["mlx-lm", c]
        print(
            f"| {c} | {ours['aggregate_tps']:.1f} | {ours['aggregate_tps'] / base['mlxinfer']:.2f}× | "
            f"{theirs['aggregate_tps']:.1f} | {theirs['aggregate_tps'] / base['mlx-lm']:.2f}× | "
            f"{ours['aggregate_tps'] / theirs['aggregate_tps']:.2f}× | "
            f"{ours['ttft_p50_s'] * 1000:.0f} / {ours['ttft_p99_s'] * 1000:.0f} ms | "
            f"{theirs['ttft_p50_s'] * 1000:.0f} / {theirs['ttft_p99_s'] * 1000:.0f} ms |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"environment": environment("mlx-lm"), "rounds": args.rounds, "rows": rows},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
