"""A day of mixed load, compressed: `mlxinfer serve` under clients that stream, hang up and misbehave.

    python tools/soak.py [--model DIR] [--minutes 5] [--clients 16] [--burst 64] [--ranks N]
                         [--json OUT] [--check]

It starts `mlxinfer serve` on 127.0.0.1 (SmolLM2-135M-Instruct dequantized to float32 by
default, imported once into the user cache; with ``--ranks N`` across N local pipeline ranks
under `mlxinfer launch`, the batching engine's flights and cancellations across ranks) and runs,
for the given time:

- ``--clients`` loopback clients, each looping over a weighted mix: OpenAI streamed and whole
  chat replies, Anthropic streams, hang-ups after a few chunks, long prompts, and hostile
  requests (each must be a 4xx in the API's own JSON error shape);
- ``--slow-clients`` that send their body a byte a second (the server must give up on them);
- a burst of ``--burst`` streams at once, halfway through;
- a ``/health`` poller (every 0.2 s) and an RSS sampler (every 2 s).

Then it waits for the server to drain, reads the KV blocks still in use from ``/metrics``,
sends SIGTERM and times the exit. It prints one table (and ``--json``): requests served, 5xx,
connection failures, hostile requests answered in shape, KV blocks in use once drained, RSS at
minute 1, before the burst, a minute after it and at the end, ``/health`` p99 (overall and
during the burst), TTFT p50/p99, tokens/s in the first and last minute, and the exit.
``--check`` exits 1 when a figure misses the issue's bar (the RSS bars only on runs of 3
minutes or more). Every request has a timeout and the whole run stops by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REQUEST_TIMEOUT = 300.0  # no single request may take longer than this, burst included
PROMPTS = [
    "Tell me a short story about the number {i}, in three sentences.",
    "List three facts about the colour of the sky on day {i}.",
    "Write a haiku about request number {i}.",
    "Explain, briefly, why {i} is or is not a prime number.",
]
LONG_PROMPT = ("The quick brown fox jumps over the lazy dog. " * 160) + "Summarise that text."
MIX = {"stream": 30, "whole": 15, "anthropic": 15, "hangup": 12, "long": 6, "hostile": 22}


# ---------------------------------------------------------------- what we record
@dataclass
class Stats:
    t0: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    served: dict = field(default_factory=dict)  # kind -> requests answered 2xx
    errors_5xx: list = field(default_factory=list)
    connection_failures: list = field(default_factory=list)
    hostile: int = 0
    hostile_in_shape: int = 0
    hostile_wrong: list = field(default_factory=list)
    ttft: list = field(default_factory=list)  # (time sent, seconds to the first token)
    chunks: list = field(default_factory=list)  # times of content chunks
    health: list = field(default_factory=list)  # (time, seconds, status)
    rss: list = field(default_factory=list)  # (time, bytes)
    mlx: list = field(default_factory=list)  # (time, MLX's active bytes, its buffer cache's)
    burst: tuple = (None, None)  # (start, end)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, attr: str, value) -> None:
        with self.lock:
            getattr(self, attr).append(value)

    def count(self, kind: str) -> None:
        with self.lock:
            self.served[kind] = self.served.get(kind, 0) + 1


# ---------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_f32_model() -> Path:
    """SmolLM2-135M-Instruct's GGUF dequantized to float32, imported once into the user cache."""
    from mlxinfer.gguf import import_gguf
    from mlxinfer.loading.default_model import fetch_smollm2_gguf
    from mlxinfer.platform.machine import user_cache_dir

    dst = user_cache_dir() / "models" / "SmolLM2-135M-Instruct-f32"
    if not (dst / "config.json").is_file():
        with tempfile.TemporaryDirectory() as work:
            import_gguf(fetch_smollm2_gguf(Path(work)), dst, dtype="float32")
    return dst


def start_server(
    model: Path, port: int, extra: list[str], log: Path, ranks: int = 1
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlxinfer", "serve", "-m", str(model), "--port", str(port)]
    if ranks > 1:  # under our launcher: a pipeline over local ranks, rank 0 serving
        launch = [sys.executable, "-m", "mlxinfer", "launch", "-n", str(ranks), "--"]
        cmd = launch + cmd + ["--distributed", "pipeline"]
    proc = subprocess.Popen(
        cmd + extra, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), start_new_session=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not answer /health within 300 s")


def rss_bytes(pid: int) -> int | None:
    """The process's resident bytes, its children's added (a launcher's ranks)."""
    try:
        total = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total = int(line.split()[1]) * 1024
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return total + sum(rss_bytes(int(c)) or 0 for c in children)


def metrics(url: str) -> dict[str, float]:
    """The engine gauges of ``/metrics``, summed over models (``mlxinfer_kv_blocks_in_use`` ...)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("mlxinfer_") and " " in line:
            key, value = line.rsplit(" ", 1)
            key = key.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


# ---------------------------------------------------------------- well-behaved clients
def chat_body(name: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    return {
        "model": name,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "stream": stream,
    }


def openai_stream(client, url, name, stats: Stats, prompt, max_tokens, hang_up_after=None):
    sent = stats.now()
    first, seen = None, 0
    with client.stream(
        "POST", f"{url}/v1/chat/completions", json=chat_body(name, prompt, max_tokens, True)
    ) as r:
        if r.status_code != 200:
            return r.status_code, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                t = stats.now()
                if first is None:
                    first = t
                    stats.add("ttft", (sent, first - sent))
                stats.add("chunks", t)
                seen += 1
                if hang_up_after is not None and seen >= hang_up_after:
                    return 200, b""  # closing the response hangs up mid-stream
    return 200, b""


def anthropic_stream(client, url, name, stats: Stats, prompt, max_tokens):
    body = {
        "model": name,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
    }
    sent, first = stats.now(), None
    with client.stream("POST", f"{url}/v1/messages", json=body) as r:
        if r.status_code != 200:
            return r.status_code, r.read()
        for line in r.iter_lines():
            if line.startswith("data:") and '"text_delta"' in line:
                t = stats.now()
                if first is None:
                    first = t
                    stats.add("ttft", (sent, first - sent))
                stats.add("chunks", t)
    return 200, b""


# ---------------------------------------------------------------- hostile requests
def hostile_requests(name: str) -> list[tuple[str, str, str, dict, bytes]]:
    """(label, api, path, headers, body) of requests every server must refuse with a 4xx."""
    j = {"content-type": "application/json"}

    def js(obj) -> bytes:
        return json.dumps(obj).encode()

    ok = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    an = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat, msgs = "/v1/chat/completions", "/v1/messages"
    hostile = {
        "truncated JSON": ("openai", chat, j, b'{"model": '),
        "deep JSON": ("openai", chat, j, b"[" * 100_000 + b"]" * 100_000),
        "temperature NaN": ("openai", chat, j, js(ok)[:-1] + b', "temperature": NaN}'),
        "temperature a string": ("openai", chat, j, js({**ok, "temperature": "hot"})),
        "seed 2**70": ("openai", chat, j, js({**ok, "seed": 2**70})),
        "top_p -1": ("openai", chat, j, js({**ok, "top_p": -1})),
        "max_tokens -5": ("openai", chat, j, js({**ok, "max_tokens": -5})),
        "messages a string": ("openai", chat, j, js({**ok, "messages": "not a list"})),
        "text/plain body": ("openai", chat, {"content-type": "text/plain"}, js(ok)),
        "Host evil.example": ("openai", chat, {**j, "host": "evil.example"}, js(ok)),
        "unknown model": ("openai", chat, j, js({**ok, "model": "no-such-model"})),
        "2 MB prompt": (
            "openai",
            chat,
            j,
            js({**ok, "messages": [{"role": "user", "content": "x" * 2_000_000}]}),
        ),
        "token id 10**9": (
            "openai",
            "/v1/completions",
            j,
            js({"model": name, "prompt": [10**9], "max_tokens": 2}),
        ),
        "max_tokens a string": ("anthropic", msgs, j, js({**an, "max_tokens": "many"})),
        "role wizard": (
            "anthropic",
            msgs,
            j,
            js({**an, "messages": [{"role": "wizard", "content": "x"}]}),
        ),
        "not UTF-8": ("anthropic", msgs, j, b"\xff\xfe not utf-8"),
    }
    return [(label, *request) for label, request in hostile.items()]


def in_shape(api: str, body: bytes) -> bool:
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    if api == "anthropic":
        return doc.get("type") == "error" and isinstance(doc.get("error", {}).get("message"), str)
    return isinstance(doc.get("error"), dict) and isinstance(doc["error"].get("message"), str)


def send_hostile(client, url, stats: Stats, request) -> int:
    label, api, path, headers, body = request
    r = client.post(f"{url}{path}", headers=headers, content=body)
    with stats.lock:
        stats.hostile += 1
        if 400 <= r.status_code < 500 and in_shape(api, r.content):
            stats.hostile_in_shape += 1
        else:
            stats.hostile_wrong.append(f"{label}: {r.status_code} {r.content[:120]!r}")
    return r.status_code


def slow_body(port: int, stats: Stats, deadline: float) -> None:
    """Send a chat request's headers and then its body a byte a second; the server must answer
    (408) or close the connection before we run out of body or the deadline."""
    body = b'{"messages": [{"role": "user", "content": "' + b"y" * 200 + b'"}]}'
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head)
        for i in range(len(body)):
            if time.monotonic() > deadline:
                return
            try:
                s.sendall(body[i : i + 1])
                s.settimeout(1.0)
                reply = s.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                stats.count("slow_body_dropped")
                return
            if reply == b"" or reply.startswith(b"HTTP/1.1 4"):
                stats.count("slow_body_refused")
                return
            stats.add("errors_5xx", f"slow body answered {reply[:60]!r}")
            return
    stats.add("connection_failures", "slow body: the server kept waiting for the whole body")


# ---------------------------------------------------------------- one client's loop
def one_request(kind, client, url, name, stats: Stats, rng: random.Random, hostiles) -> None:
    prompt = rng.choice(PROMPTS).format(i=rng.randrange(10_000))
    try:
        if kind == "hostile":
            code = send_hostile(client, url, stats, rng.choice(hostiles))
            if code >= 500:
                stats.add("errors_5xx", f"hostile request answered {code}")  # also in hostile_wrong
            return
        if kind == "whole":
            r = client.post(
                f"{url}/v1/chat/completions",
                json=chat_body(name, prompt, rng.randint(8, 48), False),
            )
            code, body = r.status_code, r.content
        elif kind == "anthropic":
            code, body = anthropic_stream(client, url, name, stats, prompt, rng.randint(8, 48))
        elif kind == "hangup":
            code, body = openai_stream(client, url, name, stats, prompt, 64, rng.randint(1, 3))
        elif kind == "long":
            code, body = openai_stream(client, url, name, stats, LONG_PROMPT, 16)
        else:
            code, body = openai_stream(client, url, name, stats, prompt, rng.randint(8, 64))
    except (httpx.TransportError, OSError) as e:
        stats.add("connection_failures", f"{kind}: {type(e).__name__}: {e}")
        return
    if code >= 500:
        stats.add("errors_5xx", f"{kind}: {code} {body[:200]!r}")
    elif code == 200:
        stats.count(kind)
    else:
        stats.add("hostile_wrong", f"{kind}: a well-formed request answered {code} {body[:200]!r}")


def client_loop(i, url, name, stats: Stats, deadline: float, seed: int) -> None:
    rng = random.Random(seed * 1000 + i)
    kinds, weights = zip(*MIX.items())
    hostiles = hostile_requests(name)
    with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
        while time.monotonic() < deadline:
            one_request(rng.choices(kinds, weights)[0], client, url, name, stats, rng, hostiles)


def health_loop(url: str, stats: Stats, stop: threading.Event) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                code = client.get(f"{url}/health").status_code
            except httpx.HTTPError:
                code = 0
            stats.add("health", (stats.now(), time.perf_counter() - t, code))
            stop.wait(0.2)


def rss_loop(pid: int, url: str, stats: Stats, stop: threading.Event) -> None:
    """The server's RSS every 2 s, and MLX's own figures from /metrics every 10 s."""
    tick = 0
    while not stop.is_set():
        value = rss_bytes(pid)
        if value:
            stats.add("rss", (stats.now(), value))
        if tick % 5 == 0:
            try:
                m = metrics(url)
                active, cached = (
                    m.get("mlxinfer_mlx_active_bytes"),
                    m.get("mlxinfer_mlx_cache_bytes"),
                )
                stats.add("mlx", (stats.now(), active, cached))
            except httpx.HTTPError:
                pass
        tick += 1
        stop.wait(2.0)


def burst(url: str, name: str, stats: Stats, n: int) -> None:
    start = stats.now()
    threads = [
        threading.Thread(
            target=lambda i=i: one_request(
                "stream", httpx.Client(timeout=REQUEST_TIMEOUT), url, name, stats,
                random.Random(i), [],
            )
        )
        for i in range(n)
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT + 10)
    stats.burst = (start, stats.now())


# ---------------------------------------------------------------- the report
def pct(values, q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def rss_at(stats: Stats, t: float) -> int | None:
    """The RSS sample nearest to ``t`` seconds into the run."""
    if not stats.rss:
        return None
    return min(stats.rss, key=lambda s: abs(s[0] - t))[1]


def mlx_at(stats: Stats, t: float) -> dict | None:
    """MLX's active and cached MB nearest to ``t`` seconds into the run."""
    rows = [row for row in stats.mlx if row[1] is not None]
    if not rows:
        return None
    _, active, cached = min(rows, key=lambda s: abs(s[0] - t))
    return {"active": round(active / 2**20, 1), "cache": round((cached or 0) / 2**20, 1)}


def report(stats: Stats, run_s: float, drained_blocks, exit_s, exit_code) -> dict:
    b0, b1 = stats.burst
    during = [s for t, s, _ in stats.health if b0 is not None and b0 <= t <= b1]
    last = max((t for t in stats.chunks), default=run_s)
    first_min = sum(1 for t in stats.chunks if t < 60) / 60
    last_min = sum(1 for t in stats.chunks if last - 60 <= t <= last) / 60
    rss1, rss_end = rss_at(stats, 60), rss_at(stats, run_s)
    pre_burst = rss_at(stats, b0 - 1) if b0 is not None else None
    after_burst = rss_at(stats, b1 + 60) if b1 is not None and b1 + 60 <= run_s else None
    return {
        "requests_served": dict(sorted(stats.served.items())),
        "requests_served_total": sum(stats.served.values()),
        "errors_5xx": len(stats.errors_5xx),
        "connection_failures": len(stats.connection_failures),
        "hostile": stats.hostile,
        "hostile_4xx_in_shape": stats.hostile_in_shape,
        "kv_blocks_in_use_drained": drained_blocks,
        "rss_minute_1_mb": rss1 and rss1 / 2**20,
        "rss_pre_burst_mb": pre_burst and pre_burst / 2**20,
        "rss_burst_plus_60s_mb": after_burst and after_burst / 2**20,
        "rss_end_mb": rss_end and rss_end / 2**20,
        "rss_growth_pct": rss1 and rss_end and 100 * (rss_end - rss1) / rss1,
        "rss_after_burst_vs_pre_pct": pre_burst
        and after_burst
        and 100 * (after_burst - pre_burst) / pre_burst,
        "mlx_minute_1_mb": mlx_at(stats, 60),
        "mlx_end_mb": mlx_at(stats, run_s),
        "health_polls": len(stats.health),
        "health_failures": sum(1 for _, _, c in stats.health if c != 200),
        "health_p99_ms": (pct([s for _, s, _ in stats.health], 0.99) or 0) * 1000,
        "health_p99_burst_ms": (pct(during, 0.99) or 0) * 1000,
        "ttft_p50_ms": (pct([s for _, s in stats.ttft], 0.5) or 0) * 1000,
        "ttft_p99_ms": (pct([s for _, s in stats.ttft], 0.99) or 0) * 1000,
        "tokens_per_s_first_minute": first_min,
        "tokens_per_s_last_minute": last_min,
        "sigterm_exit_s": exit_s,
        "sigterm_exit_code": exit_code,
        "samples": {
            "errors_5xx": stats.errors_5xx[:5],
            "connection_failures": stats.connection_failures[:5],
            "hostile_wrong": stats.hostile_wrong[:5],
        },
    }


def failures(r: dict, minutes: float, ranks: int = 1) -> list[str]:
    """The issue's bar, each miss as a line. Across ranks the server is ``mlxinfer launch``,
    which ends its ranks on SIGTERM and exits with 128 + the signal (docs/distributed.md)."""
    clean = (0, -signal.SIGTERM) if ranks == 1 else (128 + signal.SIGTERM,)
    out = []
    if r["errors_5xx"]:
        out.append(f"{r['errors_5xx']} 5xx answers")
    if r["connection_failures"]:
        out.append(f"{r['connection_failures']} connection failures")
    if r["hostile_4xx_in_shape"] != r["hostile"] or r["samples"]["hostile_wrong"]:
        out.append(f"hostile requests in shape: {r['hostile_4xx_in_shape']}/{r['hostile']}")
    if r["kv_blocks_in_use_drained"] != 0:
        out.append(f"{r['kv_blocks_in_use_drained']} KV blocks in use after draining")
    if r["health_p99_burst_ms"] >= 500:
        out.append(f"/health p99 during the burst {r['health_p99_burst_ms']:.0f} ms >= 500")
    if r["sigterm_exit_code"] not in clean or r["sigterm_exit_s"] > 10:
        out.append(f"SIGTERM exit: code {r['sigterm_exit_code']} after {r['sigterm_exit_s']} s")
    if minutes >= 3:
        if (r["rss_growth_pct"] or 0) >= 5:
            out.append(f"RSS grew {r['rss_growth_pct']:.1f}% from minute 1 to the end")
        if r["rss_after_burst_vs_pre_pct"] is not None and r["rss_after_burst_vs_pre_pct"] >= 10:
            out.append(f"RSS a minute after the burst {r['rss_after_burst_vs_pre_pct']:.1f}% over")
        if r["tokens_per_s_last_minute"] < 0.9 * r["tokens_per_s_first_minute"]:
            out.append("last minute's tokens/s under 90% of the first minute's")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="model directory (default: SmolLM2-135M f32)")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--slow-clients", type=int, default=2)
    ap.add_argument("--burst", type=int, default=64, help="streams sent at once, halfway through")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-arg", action="append", default=[], help="passed to `serve`")
    ap.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="serve across this many local pipeline ranks (mlxinfer launch): RSS is every rank's",
    )
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("--check", action="store_true", help="exit 1 when a figure misses the bar")
    args = ap.parse_args(argv)

    model = args.model or default_f32_model()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1])
    proc = start_server(model, port, args.server_arg, log, args.ranks)
    name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    stats = Stats()
    run_s = args.minutes * 60
    deadline = time.monotonic() + run_s
    stop = threading.Event()
    background = [
        threading.Thread(target=health_loop, args=(url, stats, stop), daemon=True),
        threading.Thread(target=rss_loop, args=(proc.pid, url, stats, stop), daemon=True),
    ]
    clients = [
        threading.Thread(target=client_loop, args=(i, url, name, stats, deadline, args.seed))
        for i in range(args.clients)
    ] + [
        threading.Thread(target=slow_body, args=(port, stats, deadline))
        for _ in range(args.slow_clients)
    ]
    try:
        for t in background + clients:
            t.start()
        wait = run_s / 2 - (time.monotonic() - (deadline - run_s))
        time.sleep(max(0.0, wait))
        if args.burst:
            burst(url, name, stats, args.burst)
        for t in clients:
            t.join(max(1.0, deadline - time.monotonic()) + REQUEST_TIMEOUT)
        elapsed = stats.now()
        drained, m = None, {}
        drain_deadline = time.monotonic() + 60
        while time.monotonic() < drain_deadline:
            m = metrics(url)
            drained = int(m.get("mlxinfer_kv_blocks_in_use", 0))
            if drained == 0 and m.get("mlxinfer_requests_running", 0) == 0:
                break
            time.sleep(0.5)
        stop.set()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
            exit_s = round(time.monotonic() - sent, 2)
        except subprocess.TimeoutExpired:
            code, exit_s = None, 30.0
    finally:
        stop.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    r = report(stats, elapsed, drained, exit_s, code)
    r["decode_flights"] = int(m.get("mlxinfer_decode_flights_total", 0))  # across ranks
    r["config"] = {
        "model": str(model),
        "minutes": args.minutes,
        "clients": args.clients,
        "slow_clients": args.slow_clients,
        "burst": args.burst,
        "seed": args.seed,
        "ranks": args.ranks,
    }
    from mlxinfer.bench.bandwidth import environment

    r["machine"] = environment(None)
    misses = failures(r, args.minutes, args.ranks)
    r["failures"] = misses
    for key, value in r.items():
        if key not in ("machine", "samples", "config"):
            print(f"{key:30} {value if not isinstance(value, float) else round(value, 2)}")
    for key, values in r["samples"].items():
        for v in values:
            print(f"  {key}: {v}")
    print("server log:", log)
    if args.json:
        args.json.write_text(json.dumps(r, indent=2, default=str))
    print("soak: " + ("OK" if not misses else "FAILED: " + "; ".join(misses)))
    return 1 if (args.check and misses) else 0


if __name__ == "__main__":
    sys.exit(main())
