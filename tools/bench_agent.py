"""A coding agent's turns: time to first token of turn 2 against turn 1, and after a restart.

    python tools/bench_agent.py [--models dense,hybrid] [--tokens 4000] [--repeat 3] [--json OUT]

An agent-style conversation of about ``--tokens`` prompt tokens (a long system prompt with tool
schemas, then user requests, assistant replies and tool outputs) is sent to `mlxinfer serve`
as turn 1; turn 2 is the same conversation grown by an assistant reply and a tool result, as
a coding agent's next request is. For each model it measures, on a loopback server:

- ``turn 1``: the whole conversation, cold (after a short unrelated warm-up request);
- ``turn 2``: the grown conversation right after, on the same server (the prefix cache's case);
- ``restart``: turn 2 on a restarted server (SIGTERM, start again): computed from scratch;
- ``restart + disk``: the same with ``--prefix-cache-dir`` on both servers (turn 1 sent to the
  first), when this build's serve accepts the flag; otherwise the row says why it is missing.

Time to first token is the latency of the request with ``max_tokens: 1`` (greedy, not
streamed): prefill and one decode step, as a client sees it. Each figure is the median of
``--repeat`` runs, each on fresh servers; ``cached_tokens`` is the server's own
``usage.prompt_tokens_details.cached_tokens``.

Models: ``dense``: SmolLM2-135M-Instruct dequantized to float32 (imported once into the user
cache from its GGUF, as tools/soak.py does); ``hybrid``: a tiny random Qwen3.5 checkpoint
(three Gated DeltaNet layers and one attention layer, written with transformers, needs torch),
with a small byte-level tokenizer and a ChatML template.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import json
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxinfer  # noqa: E402,F401  (the fast BLAS)
import httpx  # noqa: E402

from mlxinfer.platform.machine import user_cache_dir  # noqa: E402

TOOLS = [
    {
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {k: {"type": "string", "description": f"The {k} to use."} for k in props},
            "required": props[:1],
        },
    }
    for name, description, props in [
        ("read_file", "Read a file of the workspace and return its text.", ["path", "range"]),
        ("write_file", "Write text to a file of the workspace.", ["path", "content"]),
        ("run_command", "Run a shell command in the workspace.", ["command", "cwd"]),
        ("search", "Search the workspace for a regular expression.", ["pattern", "glob"]),
        ("list_dir", "List a directory of the workspace.", ["path"]),
        ("apply_patch", "Apply a unified diff to the workspace.", ["patch"]),
    ]
]
SYSTEM = (
    "You are a coding agent working in the user's repository. Read before you edit, keep "
    "changes small, run the tests after each change, and explain what you did in one short "
    "paragraph. Never invent file contents; call a tool to read them.\n\n# Tools\n"
    + "\n".join(json.dumps(t) for t in TOOLS)
)
CODE = '''def parse_config(path):
    """Read a key = value file into a dict, ignoring comments and blank lines."""
    out = {}
    for n, line in enumerate(open(path), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}:{n}: expected key = value, found {line!r}")
        out[key.strip()] = value.strip()
    return out
'''


def exchange(i: int) -> list[dict]:
    """One step of agent work: a request, the agent's call, the tool's output."""
    return [
        {"role": "user", "content": f"Step {i}: look at config_{i}.py and fix what is wrong."},
        {
            "role": "assistant",
            "content": f'Calling read_file with {{"path": "src/config_{i}.py"}}.',
        },
        {"role": "user", "content": f"Tool output (read_file src/config_{i}.py):\n{CODE}"},
    ]


def conversation(tokenizer, target: int) -> tuple[list[dict], list[dict]]:
    """(turn 1's messages, about ``target`` tokens; turn 2's: those grown by a reply and a
    tool result)."""
    messages = [{"role": "system", "content": SYSTEM}]
    i = 0
    while count(tokenizer, messages) < target:
        messages += exchange(i)
        i += 1
    turn2 = messages + [
        {"role": "assistant", "content": "The parser misses a check. Calling run_command."},
        {"role": "user", "content": "Tool output (run_command pytest -q):\n3 passed in 0.04s"},
    ]
    return messages, turn2


def count(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------- models
def dense_model() -> Path:
    """SmolLM2-135M-Instruct's GGUF dequantized to float32, imported once (as tools/soak.py)."""
    from mlxinfer.loading.default_model import fetch_smollm2_gguf
    from mlxinfer.gguf import import_gguf

    dst = user_cache_dir() / "models" / "SmolLM2-135M-Instruct-f32"
    if not (dst / "config.json").is_file():
        with tempfile.TemporaryDirectory() as work:
            import_gguf(fetch_smollm2_gguf(Path(work)), dst, dtype="float32")
    return dst


def hybrid_model(work: Path) -> Path:
    """A tiny random Qwen3.5 checkpoint (Gated DeltaNet x3, attention x1), 8k positions."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from hf_models import add_tokenizer, make_tiny

    path = work / "tiny-qwen3_5"
    make_tiny(
        path,
        "qwen3_5_text",
        hidden_size=256,
        intermediate_size=512,
        head_dim=32,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        max_position_embeddings=8192,
        vocab_size=320,  # add_tokenizer's
    )
    add_tokenizer(path, vocab_size=320)
    return path


# ---------------------------------------------------------------- the server
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, extra: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mlxinfer", "serve", "-m", str(model)]
        cmd += ["--port", str(self.port), *extra]
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:]
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {' '.join(tail)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            self.stop()
            raise RuntimeError("serve did not answer /health within 300 s")
        self.name = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def first_token(self, messages: list[dict]) -> tuple[float, int, int]:
        """(seconds for a max_tokens=1 request, its prompt tokens, its cached tokens)."""
        body = {"model": self.name, "messages": messages, "max_tokens": 1, "temperature": 0}
        t = time.perf_counter()
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=600)
        seconds = time.perf_counter() - t
        if r.status_code != 200:
            raise RuntimeError(f"chat completion: {r.status_code} {r.text[:300]}")
        usage = r.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return seconds, usage["prompt_tokens"], cached

    def warm_up(self) -> None:
        self.first_token([{"role": "user", "content": "Hi."}])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: what a restart sends
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ---------------------------------------------------------------- the measurements
def measure(model: Path, turn1, turn2, work: Path, repeat: int) -> list[dict]:
    log = work / "serve.log"
    runs: dict[str, list[tuple[float, int, int]]] = {}
    missing: dict[str, str] = {}

    def add(label, value):
        runs.setdefault(label, []).append(value)
        print(f"  {label}: {value[0]:.3f} s, prompt {value[1]}, cached {value[2]}", flush=True)

    for _ in range(repeat):
        srv = Server(model, [], log)
        try:
            srv.warm_up()
            add("turn 1", srv.first_token(turn1))
            add("turn 2", srv.first_token(turn2))
        finally:
            srv.stop()
        srv = Server(model, [], log)
        try:
            srv.warm_up()
            add("restart", srv.first_token(turn2))
        finally:
            srv.stop()
        disk = work / "prefix-cache"
        shutil.rmtree(disk, ignore_errors=True)
        try:
            srv = Server(model, ["--prefix-cache-dir", str(disk)], log)
        except RuntimeError as e:
            missing["restart + disk"] = str(e)
            continue
        try:
            srv.warm_up()
            srv.first_token(turn1)
        finally:
            srv.stop()
        srv = Server(model, ["--prefix-cache-dir", str(disk)], log)
        try:
            srv.warm_up()
            add("restart + disk", srv.first_token(turn2))
        finally:
            srv.stop()
    rows = []
    for label in ("turn 1", "turn 2", "restart", "restart + disk"):
        if label in runs:
            values = runs[label]
            rows.append(
                {
                    "case": label,
                    "ttft_s": round(statistics.median(v[0] for v in values), 3),
                    "prompt_tokens": values[-1][1],
                    "cached_tokens": values[-1][2],
                    "runs": [round(v[0], 3) for v in values],
                }
            )
        else:
            rows.append({"case": label, "missing": missing.get(label, "not measured")})
    return rows


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    from mlxinfer.tokenization.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="dense,hybrid", help="comma-separated: dense, hybrid")
    ap.add_argument("--tokens", type=int, default=4000, help="turn 1's prompt tokens, about")
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure (the median)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import os

    # SIGTERM (a timeout, a CI job cancelled) unwinds like Ctrl-C: the servers, in sessions of
    # their own, are stopped by the `finally` blocks instead of being left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    result = {"machine": f"{cpu_name()}, {os.cpu_count()} cores", "models": {}}
    print(f"machine: {result['machine']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        work = Path(tmp)
        for kind in [m.strip() for m in args.models.split(",") if m.strip()]:
            model = dense_model() if kind == "dense" else hybrid_model(work)
            tok = Tokenizer.from_dir(model)
            turn1, turn2 = conversation(tok, args.tokens)
            print(f"{kind}: {model.name}, turn 1 {count(tok, turn1)} tokens", flush=True)
            rows = measure(model, turn1, turn2, work, args.repeat)
            result["models"][kind] = {"model": model.name, "rows": rows}
            cold = next((r["ttft_s"] for r in rows if r["case"] == "turn 1"), None)
            print(f"\n{kind}: {model.name}", flush=True)
            for r in rows:
                if "missing" in r:
                    print(f"  {r['case']:<15} missing: {r['missing']}", flush=True)
                    continue
                ratio = f"{r['ttft_s'] / cold:.2f}x turn 1" if cold else ""
                print(
                    f"  {r['case']:<15} {r['ttft_s']:7.3f} s  {ratio:<13} prompt "
                    f"{r['prompt_tokens']}, cached {r['cached_tokens']}  runs {r['runs']}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
