"""Long-context check of the quantized KV cache: memory saved, greedy output kept.

Issue #5's target: at ~8k tokens of context, the 8-bit KV cache (group 64)
holds at most 0.6× the bytes of the float cache, and greedy decoding of a
fixed prompt gives the same first 32 tokens as with the float cache — or the
first divergence is reported.

One model, one prompt, three runs of ``mlxinfer.generation.generate_step``
(greedy, EOS ignored, exactly ``max_tokens`` tokens), differing only in the
cache (``model.make_cache(kv_bits=...)``):

- float: the model's compute dtype (float32 on MLX's CPU backend, where
  ``mlxinfer.load`` widens the weights; float16/bfloat16 on a Mac);
- ``kv_bits=8`` and, for information, ``kv_bits=4``, both group 64.

Per run: KV-cache bytes of the tokens held after the run (the layers'
``nbytes``); MLX's peak memory (``mx.reset_peak_memory()`` before,
``mx.get_peak_memory()`` after) and its rise above the memory in use at the
start (the resident weights); time to first token (prefill of the whole
prompt plus one token); decode tok/s; the token ids. Then, untimed, each cache
is rewound to the prompt and fed the float run's tokens in one pass: at how
many steps of that same text does it make the float cache's greedy choice
(teacher forcing: a divergence at a near-tie no longer hides every later
step), and how close the two choices were where the runs diverged.

The 8-bit cache's size is compared with the float cache actually run *and*
with a float16 cache of the same tokens (float elements × 2 bytes, computed,
not run), since the ratio depends on the float dtype: 8-bit groups of 64 with
float32 scale and bias take (8·64 + 2·32) / (32·64) = 0.28 of float32 but
0.56 of float16.

The prompt: a fixed document — by default this repository's README.md as of
commit ``DOCUMENT_REV`` (read with ``git show``, so editing README.md does not
change it) — cut to whole lines so that the chat-templated prompt, which ends
by asking for a summary, is about ``--prompt-tokens`` long.

    python tools/bench_long_context.py --model /tmp/smol-f32          # ~8k prompt, 48 tokens
    python tools/bench_long_context.py                                # convert SmolLM2 f32 first
    python tools/bench_long_context.py --model DIR -p 2000 -n 32 --document notes.txt --json out.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from mlxinfer.platform.blas import blas_in_use, preload_openblas

preload_openblas()  # before the first `import mlx`: MLX's CPU matmuls must bind to OpenBLAS

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

DOCUMENT_REV = "86fa530"  # README.md at this commit is the default document (~9,100 SmolLM2 tokens)
QUESTION = (
    "Summarize the document above in a few sentences: what is it about, and what does it offer?"
)
TARGET_KV_RATIO = 0.6  # 8-bit cache bytes / float cache bytes, at most
TARGET_IDENTICAL = 32  # leading greedy tokens equal to the float cache's, at least
NEAR_TIE = 0.1  # top-1 minus top-2 log-prob below which a greedy choice is called a near-tie


@dataclass
class Run:
    """One greedy generation with one kind of cache."""

    cache: str  # "float32", "8-bit g64", ...
    kv_bits: int | None
    kv_dtype: str  # dtype of the cached keys (the scales' dtype when quantized)
    kv_bytes: int  # bytes of the cached tokens after the run, summed over layers
    kv_float16_bytes: int  # a float16 cache of the same tokens (float runs only; else 0)
    peak_memory_bytes: int  # MLX's peak during the run (weights included)
    peak_rise_bytes: int  # that peak less the memory in use at the start (the weights)
    ttft_s: float  # prefill of the whole prompt + the first token
    decode_tps: float
    tokens: list[int]
    forced_tokens: list[
        int
    ]  # its greedy choice at each step of the reference continuation (teacher forcing)


# ---------------------------------------------------------------- prompt


def read_document(path: Path | None = None) -> tuple[str, str]:
    """The document's text and a description of where it came from."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8"), str(path)
    try:
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{DOCUMENT_REV}:README.md"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(
            f"Error: cannot read README.md at {DOCUMENT_REV} with git ({e}); pass --document FILE"
        ) from None
    return text, f"README.md at {DOCUMENT_REV}"


def build_prompt(
    tokenizer, document: str, prompt_tokens: int, question: str = QUESTION
) -> list[int]:
    """Chat-templated ids of the document's leading whole lines + ``question``, at most ``prompt_tokens``.

    The document is cut on token count, back to its last whole line, then wrapped
    as one user message; the cut shrinks by the overflow until the whole fits.
    """
    doc_ids = tokenizer.encode(document, add_special_tokens=False)
    keep = min(len(doc_ids), prompt_tokens)
    while keep > 0:
        text = tokenizer.decode(doc_ids[:keep])
        if keep < len(doc_ids) and "\n" in text:
            text = text[: text.rindex("\n")]  # whole lines only
        if text.count("```") % 2:
            text += "\n```"  # cut inside a markdown code block: close it, so the question reads as prose
        content = f"{text.rstrip()}\n\n{question}"
        ids = tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": content}]),
            add_special_tokens=False,
        )
        if len(ids) <= prompt_tokens:
            return ids
        keep -= len(ids) - prompt_tokens
    raise ValueError(
        f"prompt_tokens={prompt_tokens}: too few for the chat template and the question"
    )


# ---------------------------------------------------------------- measuring


def cache_label(kv_bits: int | None, group_size: int, dtype: str) -> str:
    return dtype if kv_bits is None else f"{kv_bits}-bit g{group_size}"


def run_once(
    model,
    ids: list[int],
    max_tokens: int,
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    reference: list[int] | None = None,
) -> tuple[Run, np.ndarray]:
    """Greedy-generate ``max_tokens`` tokens (EOS ignored) with a fresh cache of this kind.

    Then, outside the measurement, the same cache is rewound to the prompt and
    fed ``reference`` (default: its own tokens) in one pass: returns the run and
    the (max_tokens, vocab) log-probs along that continuation, so that runs can
    be compared step by step on the same context even after they diverge.
    """
    from mlxinfer.cache.prompt import PromptCache
    from mlxinfer.generation import generate_step

    gc.collect()
    mx.synchronize()
    mx.clear_cache()  # every run starts from an empty buffer cache, whatever ran before
    mx.reset_peak_memory()
    baseline = mx.get_active_memory()  # the resident weights
    pc = PromptCache(model.make_cache(kv_bits=kv_bits, kv_group_size=kv_group_size))
    tokens: list[int] = []
    t0 = time.perf_counter()
    t_first = t_last = t0
    steps = generate_step(ids, model, prompt_cache=pc, max_tokens=max_tokens)
    for token, _ in steps:
        t_last = time.perf_counter()  # `token` is a Python int: its step has finished
        if not tokens:
            t_first = t_last
        tokens.append(token)
    steps.close()
    mx.synchronize()
    peak = mx.get_peak_memory()
    ttft = t_first - t0
    decode = (len(tokens) - 1) / (t_last - t_first) if len(tokens) > 1 and t_last > t_first else 0.0
    first = pc.cache[0].state  # [keys, values] or [packed, scales, biases] × 2
    dtype = str(first[1 if kv_bits else 0].dtype).removeprefix("mlx.core.")
    kv_bytes = pc.nbytes
    # A float16 cache holds the same elements at 2 bytes each.
    f16 = 0 if kv_bits else sum(c.nbytes // c.state[0].itemsize * 2 for c in pc.cache)
    del first
    logprobs = forced_logprobs(model, pc, ids, reference or tokens)
    forced = logprobs.argmax(axis=-1).tolist()
    del pc
    return Run(
        cache_label(kv_bits, kv_group_size, dtype),
        kv_bits,
        dtype,
        kv_bytes,
        f16,
        peak,
        peak - baseline,
        ttft,
        decode,
        tokens,
        forced,
    ), logprobs


def forced_logprobs(model, pc, ids: list[int], continuation: list[int]) -> np.ndarray:
    """Log-probs of the next token after the prompt and each prefix of ``continuation``: (len, vocab).

    Rewinds ``pc`` (a PromptCache holding the prompt and more) to all but the
    prompt's last token, then feeds that token and ``continuation[:-1]`` at once.
    """
    pc.rewind(len(ids) - 1)
    feed = mx.array([[ids[-1], *continuation[:-1]]], dtype=mx.int32)  # (1, n)
    logits = model(feed, pc.cache)[0].astype(mx.float32)  # (n, vocab)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(logprobs)


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """Index of the first position where the two token lists differ (a missing token counts); None if equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def quantized_ratio(
    bits: int, group_size: int, float_bits: int, scale_bits: int | None = None
) -> float:
    """Bits of an affine-quantized group (codes + one scale + one bias) over the same values in float."""
    scale_bits = float_bits if scale_bits is None else scale_bits
    return (bits * group_size + 2 * scale_bits) / (float_bits * group_size)


def load_model(model_dir: Path):
    import mlxinfer

    model, tokenizer = mlxinfer.load(model_dir)
    mx.eval(model.parameters())  # weights mapped lazily: make them resident before measuring
    return model, tokenizer


def measure(
    model_dir: str | Path,
    *,
    document: str,
    prompt_tokens: int = 8000,
    max_tokens: int = 48,
    kv_bits: tuple[int, ...] = (8, 4),
    kv_group_size: int = 64,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Run the float cache, then each of ``kv_bits``, on one prompt; compare sizes and tokens.

    Returns a JSON-ready dict: ``runs`` (float first), and per quantized run in
    ``comparisons`` its KV-bytes ratios (vs the float cache run, vs float16),
    peak-memory ratios, leading tokens identical to the float run, the first
    divergence if any (with both caches' log-prob margins between the two tokens
    there), and ``forced_agreement``: at how many steps of the float run's own
    continuation this cache's greedy choice is the same token.
    """
    log = log or (lambda _: None)
    model, tokenizer = load_model(Path(model_dir))
    context = model.args.max_position_embeddings
    ids = build_prompt(tokenizer, document, prompt_tokens)
    if len(ids) + max_tokens > context:
        raise ValueError(
            f"{len(ids)} prompt + {max_tokens} new tokens exceed the context ({context})"
        )
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    log(f"prompt: {len(ids)} tokens; context {context}; weights {weights / 1e6:.0f} MB")
    for bits in (None, *kv_bits):  # warm-up: first-call overheads stay out of the timed runs
        run_once(model, ids[:64], 2, kv_bits=bits, kv_group_size=kv_group_size)
    runs: list[Run] = []
    logprobs: list[np.ndarray] = []  # (max_tokens, vocab) per run, along the float run's tokens
    for bits in (None, *kv_bits):
        log(
            f"  {cache_label(bits, kv_group_size, 'float')} cache: {len(ids)}-token prefill + {max_tokens} tokens …"
        )
        run, lp = run_once(
            model,
            ids,
            max_tokens,
            kv_bits=bits,
            kv_group_size=kv_group_size,
            reference=runs[0].tokens if runs else None,
        )
        log(
            f"    KV {run.kv_bytes / 1e6:.1f} MB, peak rise {run.peak_rise_bytes / 1e6:.0f} MB, "
            f"TTFT {run.ttft_s:.1f} s, decode {run.decode_tps:.2f} tok/s"
        )
        runs.append(run)
        logprobs.append(lp)
    ref, ref_lp = runs[0], logprobs[0]
    top2 = np.sort(ref_lp, axis=-1)[:, -2:]
    comparisons = {}
    for run, lp in zip(runs[1:], logprobs[1:]):
        at = first_divergence(ref.tokens, run.tokens)
        f, q = (ref.tokens[at], run.tokens[at]) if at is not None else (0, 0)
        comparisons[run.cache] = {
            "kv_bytes_vs_float": run.kv_bytes / ref.kv_bytes,
            "kv_bytes_vs_float16": run.kv_bytes / ref.kv_float16_bytes,
            "peak_memory_vs_float": run.peak_memory_bytes / ref.peak_memory_bytes,
            "peak_rise_vs_float": run.peak_rise_bytes / ref.peak_rise_bytes,
            "identical_tokens": len(ref.tokens) if at is None else at,
            "divergence": None
            if at is None
            else {
                "position": at,
                "float_token": ref.tokens[at],
                "float_text": tokenizer.decode([ref.tokens[at]]),
                "token": run.tokens[at],
                "text": tokenizer.decode([run.tokens[at]]),
                "common_prefix_text": tokenizer.decode(ref.tokens[:at]),
                # log p(float's token) - log p(this one's), under each cache, on the same context
                "float_margin": float(ref_lp[at, f] - ref_lp[at, q]),
                "margin": float(lp[at, q] - lp[at, f]),
            },
            "forced_agreement": sum(a == b for a, b in zip(run.forced_tokens, ref.tokens)),
        }
    eos = tokenizer.eos_token_ids
    return {
        "model_dir": str(model_dir),
        "prompt_tokens": len(ids),
        "max_tokens": max_tokens,
        "context": context,
        "kv_group_size": kv_group_size,
        "weight_bytes": weights,
        "prompt_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
        # The float cache's own steps: top-1 minus top-2 log-prob (small = a near-tie), and whether
        # one forward pass over its tokens picks them again (chunked vs step-by-step arithmetic).
        "float_top2_gaps": (top2[:, 1] - top2[:, 0]).tolist(),
        "float_forced_agreement": sum(a == b for a, b in zip(ref.forced_tokens, ref.tokens)),
        "runs": [
            {
                **asdict(r),
                "text": tokenizer.decode(r.tokens),
                "eos_at": next((i for i, t in enumerate(r.tokens) if t in eos), None),
            }
            for r in runs
        ],
        "comparisons": comparisons,
    }


# ---------------------------------------------------------------- report


def environment() -> dict:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": blas_in_use(),
        "cpus": os.cpu_count(),
        "load_average_1min": load,
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def markdown_table(result: dict, env: dict) -> str:
    """One row per cache kind, plus a float16 row computed from the float run; then the verdict."""
    runs, comps = result["runs"], result["comparisons"]
    ref = runs[0]
    header = (
        f"{result['prompt_tokens']}-token prompt + {result['max_tokens']} greedy tokens (EOS ignored), "
        f"context {result['context']}; MLX {env['mlx']} on {env['device']}, {env['blas']}, {env['cpus']} "
        f"CPUs; weights {_mb(result['weight_bytes'])}."
    )
    columns = (
        "KV cache",
        "KV bytes",
        "vs float run",
        "vs float16",
        "peak memory",
        "peak − weights",
        "time to first token",
        "decode",
        "leading tokens identical to float",
        "same choice on float's continuation",
    )
    lines = [header, "", "| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    f16 = ref["kv_float16_bytes"]
    for r in runs:
        c = comps.get(r["cache"])
        n = len(ref["tokens"])
        same = f"{c['identical_tokens']}/{n}" if c else "(reference)"
        forced = (
            f"{c['forced_agreement']}/{n}"
            if c
            else f"{result['float_forced_agreement']}/{n} (itself)"
        )
        prefill = f"{r['ttft_s']:.1f} s ({result['prompt_tokens'] / r['ttft_s']:.0f} tok/s)"
        lines.append(
            f"| {r['cache']} | {_mb(r['kv_bytes'])} | {r['kv_bytes'] / ref['kv_bytes']:.3f}× | "
            f"{r['kv_bytes'] / f16:.3f}× | {_mb(r['peak_memory_bytes'])} | {_mb(r['peak_rise_bytes'])} | "
            f"{prefill} | {r['decode_tps']:.2f} tok/s | {same} | {forced} |"
        )
        if r is ref and ref["kv_dtype"] != "float16":
            lines.append(
                f"| float16 (computed, not run) | {_mb(f16)} | {f16 / ref['kv_bytes']:.3f}× | 1.000× "
                "|" + " |" * (len(columns) - 4)
            )
    lines.append("")
    for name, c in comps.items():
        d = c["divergence"]
        if d is None:
            lines.append(
                f"- {name}: all {len(ref['tokens'])} greedy tokens identical to the float cache's."
            )
        else:
            lines.append(
                f"- {name}: first {d['position']} tokens identical; at token {d['position']} the float "
                f"cache gives {d['float_token']} {d['float_text']!r}, this one {d['token']} {d['text']!r} "
                f"(log-prob margin between the two: {d['float_margin']:.3f} for the float cache's choice "
                f"under the float cache, {d['margin']:.3f} for this one's under this one)."
            )
    gaps = sorted(result["float_top2_gaps"])
    close = sum(g < NEAR_TIE for g in gaps)
    lines.append(
        f"- float cache's own steps: top-1 minus top-2 log-prob median {gaps[len(gaps) // 2]:.2f}, "
        f"smallest {gaps[0]:.3f}; {close} of {len(gaps)} under {NEAR_TIE} (near-ties that any "
        "perturbation of the cache may flip)."
    )
    target = f"{result['kv_group_size']}"
    q8 = comps.get(f"8-bit g{target}")
    if q8:

        def verdict(ok: bool) -> str:
            return "met" if ok else "NOT met"

        n = len(ref["tokens"])
        same_ok = (
            "cannot tell"
            if n < TARGET_IDENTICAL
            else verdict(q8["identical_tokens"] >= TARGET_IDENTICAL)
        )
        lines.append(
            f"- target, 8-bit KV bytes ≤ {TARGET_KV_RATIO}× float: {q8['kv_bytes_vs_float']:.3f}× the "
            f"{ref['kv_dtype']} cache run ({verdict(q8['kv_bytes_vs_float'] <= TARGET_KV_RATIO)}), "
            f"{q8['kv_bytes_vs_float16']:.3f}× a float16 cache "
            f"({verdict(q8['kv_bytes_vs_float16'] <= TARGET_KV_RATIO)})."
        )
        lines.append(
            f"- target, ≥ {TARGET_IDENTICAL} leading greedy tokens identical: {q8['identical_tokens']} — "
            f"{same_ok} ({n} generated)."
        )
    eos = ref["eos_at"]
    lines.append(
        f"- float cache's answer{'' if eos is None else f' (EOS at token {eos})'}: "
        f"{ref['text'][:300]!r}"
    )
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> None:
    """Write atomically: a temporary sibling, then rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a converted model directory (default: convert SmolLM2-135M-Instruct to float32)",
    )
    parser.add_argument(
        "-p",
        "--prompt-tokens",
        type=int,
        default=8000,
        help="prompt length, at most (default 8000)",
    )
    parser.add_argument(
        "-n", "--max-tokens", type=int, default=48, help="tokens to generate (default 48)"
    )
    parser.add_argument(
        "--kv-bits",
        default="8,4",
        help="quantized caches to compare, comma-separated (default 8,4)",
    )
    parser.add_argument(
        "--group-size", type=int, default=64, help="quantization group size (default 64)"
    )
    parser.add_argument(
        "--document",
        type=Path,
        default=None,
        help=f"text to summarize (default: README.md at commit {DOCUMENT_REV})",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the full results here")
    args = parser.parse_args(argv)
    try:
        bits = tuple(int(b) for b in args.kv_bits.split(",") if b.strip())
    except ValueError:
        parser.error(f"--kv-bits: expected comma-separated integers, got {args.kv_bits!r}")
    if not bits or any(b not in (4, 8) for b in bits):
        parser.error(f"--kv-bits: choose from 4 and 8, got {args.kv_bits!r}")

    def log(msg: str) -> None:  # progress on stderr, the table alone on stdout
        print(msg, file=sys.stderr, flush=True)

    document, source = read_document(args.document)
    env = environment()
    sizes = {
        "document": document,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "kv_bits": bits,
        "kv_group_size": args.group_size,
        "log": log,
    }
    if args.model is not None:
        result = measure(args.model, **sizes)
    else:
        from fixtures import smollm2_hf_dir

        from mlxinfer.loading.convert import convert

        log("reference checkpoint (built once, cached) …")
        src = smollm2_hf_dir()
        with tempfile.TemporaryDirectory(prefix="bench-long-context-") as work:
            log(f"converting {src.name} to float32 …")
            convert(src, Path(work) / "f32", dtype="float32")
            result = measure(Path(work) / "f32", **sizes)
    result["document"] = source
    print(markdown_table(result, env))
    if args.json:
        write_json(args.json, {"environment": env, "result": result})
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
