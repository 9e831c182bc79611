"""``mlxinfer serve --distributed``: rank 0 owns the HTTP server, rank 1 follows its engine
(mlxinfer/distributed/serving.py, batching.py's ``rank0_requests``). Two ranks on 127.0.0.1,
started as tests/distributed/test_distributed.py starts them (MLX_RANK, MLX_HOSTFILE), every wait bounded.

The reference is one process serving the same checkpoint (the rest of the suite holds its
server to ``generate`` and ``generate`` to transformers): the same requests, greedy and seeded,
must give the same texts from two ranks, sent by four clients at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extras)")
pytest.importorskip("fastapi", reason="serve needs FastAPI (mlxinfer[server])")

from servers import free_port  # noqa: E402
from test_distributed import WAIT_S, Ranks, _checkpoint  # noqa: E402

NAME = "llama"
# A prompt that repeats itself, so that prompt lookup finds drafts.
LOOKUP = {"prompt": "ab ab ab ab ab ab ab ab", "max_tokens": 16, "temperature": 0}
ASKS = [
    {"prompt": "hello there", "max_tokens": 8, "temperature": 0},
    {"prompt": "abc def ghi jkl mno pqr", "max_tokens": 12, "temperature": 0},
    {"prompt": "x", "max_tokens": 5, "temperature": 0},
    {"prompt": "the cat sat", "max_tokens": 8, "temperature": 0.9, "seed": 7},
]

MODEL_DRAFTED: list[str] = []  # one process's answers to ASKS drafting with a draft model


# Past the default suite's six two-rank launches (what they check runs in-process by default, or
# in the launches kept): MLXINFER_SLOW=1 runs them.
TWO_RANKS = pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="a two-rank launch past the default suite's six: set MLXINFER_SLOW=1 to run",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny random llama (3 layers: 2 + 1 over two ranks; EOS never picked) and one process's
    answers to ``ASKS``, whole and streamed."""
    from fastapi.testclient import TestClient

    import mlxinfer
    from mlxinfer.generation.drafts import DraftModel, PromptLookup
    from mlxinfer.server import make_app

    path, _ = _checkpoint(tmp_path_factory.mktemp("served") / NAME)
    model, tokenizer = mlxinfer.load(path)
    with TestClient(make_app(model, tokenizer, NAME)) as client:
        texts = [_text(client.post("/v1/completions", json={"model": NAME, **a})) for a in ASKS]
        streamed = _streamed(client.post("/v1/completions", json=_stream(ASKS[1])).text)
    assert len(set(texts)) == len(texts) and all(texts)  # distinct: a swapped answer shows
    assert streamed == texts[1]
    with TestClient(make_app(model, tokenizer, NAME, draft=PromptLookup())) as client:
        drafted = [_text(client.post("/v1/completions", json={"model": NAME, **a})) for a in ASKS]
        usage = client.post("/v1/completions", json={"model": NAME, **LOOKUP}).json()
    assert drafted[:3] == texts[:3]  # greedy: the same tokens with drafts
    LOOKUP["text"] = usage["choices"][0]["text"]
    # The checkpoint drafting for itself: its greedy drafts are all kept.
    with TestClient(make_app(model, tokenizer, NAME, draft=DraftModel(model, tokenizer))) as client:
        MODEL_DRAFTED[:] = [
            _text(client.post("/v1/completions", json={"model": NAME, **a})) for a in ASKS
        ]
    assert MODEL_DRAFTED[:3] == texts[:3]
    return path, texts, drafted


def _text(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _stream(ask: dict) -> dict:
    return {"model": NAME, **ask, "stream": True}


def _streamed(body: str) -> str:
    """The text of an SSE stream of completion chunks."""
    text = ""
    for line in body.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            text += "".join(c.get("text", "") for c in event.get("choices", []))
    return text


def _serve(path, port: int, *more: str) -> list[str]:
    command = [sys.executable, "-m", "mlxinfer", "serve", "-m", str(path), "--port", str(port)]
    command += ["--distributed", "pipeline", "--rank-timeout", "60", "--kv-budget", "8000000"]
    return command + list(more)


def _wait_healthy(ranks: Ranks, url: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        for r in (0, 1):
            assert ranks.procs[r].poll() is None, ranks.text(0) + ranks.text(1)
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "rank 0's server did not start"
        time.sleep(0.2)


def _metric(text: str, name: str, rank: int) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="{NAME}",rank="{rank}"}} '):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} for rank {rank} in /metrics")


def _engine_metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="{NAME}"}} '):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def test_serve_across_two_ranks_matches_one_process(served, tmp_path):
    """Drafting by prompt lookup, four clients at once get one process's texts (greedy and
    seeded) and a stream, while a fifth asks rank 0's embedding model (--embedding-model:
    transformers' vectors); a repetitive prompt's drafts are kept; rank 0's /metrics has both
    ranks' KV and weight bytes; a SIGTERM to rank 0 ends both, cleanly."""
    pytest.importorskip("transformers", reason="the embedding reference is transformers")
    from test_embeddings import TEXTS, reference, write_checkpoint

    path, texts, drafted = served
    embedder = write_checkpoint(tmp_path / "tiny-embedding")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    more = ["--prompt-lookup", "--embedding-model", str(embedder[0])]
    with Ranks(tmp_path, _serve(path, port, *more)) as ranks:
        _wait_healthy(ranks, url)
        assert "follows rank 0's server" in ranks.text(1)

        def ask(a: dict) -> str:
            return _text(httpx.post(f"{url}/v1/completions", json={"model": NAME, **a}, timeout=60))

        def embed() -> list:
            body = {"model": "tiny-embedding", "input": TEXTS}
            response = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return [d["embedding"] for d in response.json()["data"]]

        with ThreadPoolExecutor(len(ASKS) + 2) as pool:
            answers = pool.map(ask, ASKS)
            stream = pool.submit(
                lambda: httpx.post(f"{url}/v1/completions", json=_stream(ASKS[1]), timeout=60)
            )
            vectors = pool.submit(embed)
            assert list(answers) == drafted  # greedy: no-draft texts; seeded: drafting's
            assert _streamed(stream.result().text) == texts[1]
            np.testing.assert_allclose(vectors.result(), reference(embedder, TEXTS), atol=1e-4)
        assert ask({k: v for k, v in LOOKUP.items() if k != "text"}) == LOOKUP["text"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert _engine_metric(metrics, "mlxinfer_draft_accepted_tokens_total") > 0
        kv = [_metric(metrics, "mlxinfer_rank_kv_bytes", r) for r in (0, 1)]
        weights = [_metric(metrics, "mlxinfer_rank_weight_bytes", r) for r in (0, 1)]
        # The same number of blocks on both ranks, of 2 layers on rank 0 and 1 on rank 1.
        assert kv[1] > 0 and kv[0] == 2 * kv[1]
        assert all(w > 0 for w in weights)
        # uvicorn ends its process with the signal it caught, after its shutdown (as one
        # process's serve does); the follower ends with rank 0's engine, cleanly.
        ranks.procs[0].send_signal(signal.SIGTERM)
        assert ranks.wait(0, 30) in (0, -signal.SIGTERM) and ranks.wait(1, 30) == 0
        assert "Finished server process" in ranks.text(0), ranks.text(0)


@TWO_RANKS
def test_a_lost_rank_fails_the_running_request_and_health(served, tmp_path):
    """--draft-model across ranks (rank 0 drafts, each verification step's drafts reach rank 1):
    greedy and seeded answers are one process's with the same draft model, drafts are kept;
    then rank 1 killed during a stream: the stream ends with an error naming it, /health
    answers 503 with it, and a new request gets the API's error; rank 0's server stays up."""
    path = served[0]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with Ranks(tmp_path, _serve(path, port, "--draft-model", str(path))) as ranks:
        _wait_healthy(ranks, url)
        for ask, expected in zip(ASKS, MODEL_DRAFTED):
            answer = httpx.post(f"{url}/v1/completions", json={"model": NAME, **ask}, timeout=60)
            assert _text(answer) == expected
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert _engine_metric(metrics, "mlxinfer_draft_accepted_tokens_total") > 0
        long = {**ASKS[0], "max_tokens": 20000}
        with httpx.stream("POST", f"{url}/v1/completions", json=_stream(long), timeout=60) as r:
            lines = r.iter_lines()
            body = [next(lines) for _ in range(3)]  # generation under way
            ranks.procs[1].kill()
            start = time.monotonic()
            body += list(lines)
        assert time.monotonic() - start < 30
        assert "lost rank 1" in "\n".join(body[3:]), body[-3:]
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and "lost rank 1" in health.json()["error"]
        after = httpx.post(f"{url}/v1/completions", json={"model": NAME, **ASKS[0]}, timeout=30)
        assert after.status_code >= 500 and "error" in after.json(), after.text
        assert ranks.procs[0].poll() is None
        ranks.procs[0].send_signal(signal.SIGTERM)
        ranks.wait(0, 30)


@pytest.mark.parametrize("flag", [["--models-dir", "."]])
def test_what_does_not_serve_across_ranks_is_refused_in_one_line(flag):
    from click.testing import CliRunner

    from mlxinfer.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", "--distributed", "pipeline", *flag])
    assert result.exit_code == 2
    assert f"{flag[0]} does not run with --distributed yet" in result.output


@TWO_RANKS
def test_chat_across_two_ranks_answers_as_one_process(served, tmp_path):
    """``chat --distributed``: rank 0's lines reach rank 1; a pause longer than the rank timeout
    between two lines (a person typing) keeps both ranks waiting, not failing."""
    import subprocess

    path, _, _ = served
    chat = [sys.executable, "-m", "mlxinfer", "chat", "-m", str(path), "--max-tokens", "6"]
    chat += ["--chat-template", "chatml"]

    def run(command: list[str], pause: float) -> subprocess.CompletedProcess:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            process.stdin.write(b"hello there\n")
            process.stdin.flush()
            time.sleep(pause)
            out, err = process.communicate(b"abc def\n", timeout=WAIT_S)
        finally:
            process.kill()
        return subprocess.CompletedProcess(command, process.returncode, out.decode(), err.decode())

    one = run(chat, 0)
    assert one.returncode == 0 and one.stdout.count(">> ") == 3, one.stderr
    launch = [sys.executable, "-m", "mlxinfer", "launch", "-n", "2", "--timeout", str(WAIT_S)]
    two = run([*launch, "--", *chat, "--distributed", "pipeline", "--rank-timeout", "3"], 6)
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.skipif(
    __import__("os").environ.get("MLXINFER_SLOW") != "1",
    reason="the real SmolLM2 served over two ranks: set MLXINFER_SLOW=1 to run",
)
def test_real_smollm2_served_over_two_pipeline_ranks(smollm2_mlx_dir, tmp_path):
    """The real SmolLM2-135M-Instruct (4-bit import, 30 layers, 9 heads / 3 KV heads) served
    over two pipeline ranks: four chat clients at once get one process's server's replies."""
    from fastapi.testclient import TestClient

    import mlxinfer
    from mlxinfer.server import make_app

    questions = ["What is the capital of France?", "Name a primary colour.", "Say hi.", "2+2?"]
    asks = [
        {"messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0}
        for q in questions
    ]
    name = "smollm2"
    model, tokenizer = mlxinfer.load(smollm2_mlx_dir)
    with TestClient(make_app(model, tokenizer, name)) as client:
        expected = [
            client.post("/v1/chat/completions", json={"model": name, **a}).json() for a in asks
        ]
    expected = [e["choices"][0]["message"]["content"] for e in expected]
    assert "Paris" in expected[0]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = _serve(smollm2_mlx_dir, port)
    with Ranks(tmp_path, command) as ranks:
        _wait_healthy(ranks, url)
        model_name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]

        def ask(a: dict) -> str:
            r = httpx.post(
                f"{url}/v1/chat/completions", json={"model": model_name, **a}, timeout=120
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(len(asks)) as pool:
            assert list(pool.map(ask, asks)) == expected
        assert "runs layers 0-14 of 30" in ranks.text(0)
