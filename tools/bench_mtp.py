"""MTP benchmark: a head trained by ``mlxinfer train-mtp`` against plain decoding (#45).

One process, one machine. The model (default: SmolLM2-135M-Instruct from the PyPI wheel the
tests use, imported to MLX) gets a head trained here unless one is given or lies beside it;
then, on eight prompts that are not among the training prompts (chat template, greedy,
``-n`` new tokens each):

- **alone**: plain decoding and ``--mtp`` at k = 1, 2, 3 and the cost-aware k (None), in
  alternating rounds (plain, k=1, k=2, k=3, auto, then again) so a busy machine hits all
  alike. Reported per configuration: decode tokens/s (``stats.decode_tps``, summed tokens over
  summed decode time), acceptance per draft position, tokens per target pass, and whether the
  tokens equal plain greedy's (they must).
- **batch 8**: the eight prompts through ``batch_generate`` at once, plain and ``draft=MTP()``
  (cost-aware k), wall time for all tokens, alternating twice.

    python tools/bench_mtp.py                          # train (300 steps) if no head, then time
    python tools/bench_mtp.py --head H.safetensors -n 128 --json out.json
    python tools/bench_mtp.py --train-steps 100        # retrain first

No timing here is a test; the machine (CPU, cores, load) is printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import mlxinfer  # noqa: E402,F401  (before mlx: the fast BLAS)

EVAL_PROMPTS = [
    "Explain how a rainbow forms.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are three good habits for staying healthy?",
    "Describe the city of Paris in a few sentences.",
    "How does a bicycle stay upright when it moves?",
    "Write a short story about a lost kitten finding its way home.",
    "What is the difference between a virus and a bacterium?",
    "Give me a checklist for packing for a weekend trip.",
]


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load_before": os.getloadavg()[0]}


def alone(model, tokenizer, prompts, n, num_draft, head):
    from mlxinfer.generation import stream_generate
    from mlxinfer.generation.mtp_drafts import MTP

    draft = MTP(head=head) if num_draft != "plain" else None
    k = None if num_draft in ("auto", "plain") else int(num_draft)
    tokens, decode_s, out = 0, 0.0, []
    drafted, accepted = [], []
    passes = 0
    for p in prompts:
        options = {"draft": draft, "num_draft": k} if draft is not None else {}
        results = list(
            stream_generate(model, tokenizer, p, max_tokens=n, chat_template=True, **options)
        )
        ids = [r.token for r in results]
        st = results[-1].stats
        out.append(ids)
        tokens += st.generation_tokens - 1
        decode_s += (st.generation_tokens - 1) / st.decode_tps if st.decode_tps else 0.0
        for i, (d, a) in enumerate(zip(st.drafted_by_position, st.accepted_by_position)):
            while len(drafted) <= i:
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += a
        passes += st.speculative_steps
    return {
        "tokens": tokens,
        "decode_s": decode_s,
        "tok_s": tokens / decode_s if decode_s else 0.0,
        "acceptance_by_position": [a / d if d else None for a, d in zip(accepted, drafted)],
        "drafted_by_position": drafted,
        "tokens_per_pass": (tokens + len(prompts)) / passes if passes else None,
    }, out


def batched(model, tokenizer, prompts, n, head, mtp):
    from mlxinfer.batch import batch_generate
    from mlxinfer.generation.mtp_drafts import MTP

    t = time.perf_counter()
    texts = batch_generate(
        model,
        tokenizer,
        prompts,
        max_tokens=n,
        chat_template=True,
        draft=MTP(head=head) if mtp else None,
    )
    return time.perf_counter() - t, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="MLX model directory [SmolLM2-135M-Instruct]")
    ap.add_argument("--head", type=Path, default=None, help="a trained head [beside the model]")
    ap.add_argument("--train-steps", type=int, default=None, help="train a head first")
    ap.add_argument("--train-tokens", type=int, default=128)
    ap.add_argument("-n", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from mlxinfer.loading.loader import load
    from mlxinfer.models.layers.mtp import HEAD_FILE

    model_dir = args.model
    if model_dir is None:
        from support.fixtures import smollm2_mlx_dir

        model_dir = str(smollm2_mlx_dir())
    model, tokenizer = load(model_dir)
    head = args.head or Path(model_dir) / HEAD_FILE
    report = {"machine": machine(), "model": model_dir, "head": str(head), "n": args.n}
    if args.train_steps is not None or not head.is_file():
        from mlxinfer.training.mtp import train_mtp

        r = train_mtp(
            model,
            tokenizer,
            output=head,
            steps=args.train_steps or 300,
            max_tokens=args.train_tokens,
            log=lambda m: print(m, file=sys.stderr, flush=True),
        )
        report["training"] = {
            k: getattr(r, k)
            for k in (
                "sequences",
                "tokens",
                "steps",
                "generate_s",
                "train_s",
                "kl_before",
                "kl_after",
                "top1_before",
                "top1_after",
                "top1_chained_before",
                "top1_chained_after",
            )
        }
        model, tokenizer = load(model_dir)  # fresh: the head attaches as a user's would
    configs = ["plain", "1", "2", "3", "auto"]
    runs: dict[str, list] = {c: [] for c in configs}
    reference = None
    for _ in range(args.rounds):
        for c in configs:
            stats, out = alone(model, tokenizer, EVAL_PROMPTS, args.n, c, head)
            if c == "plain":
                reference = out
            stats["same_as_plain"] = out == reference
            runs[c].append(stats)
            print(
                f"alone {c:>5}: {stats['tok_s']:.1f} tok/s, acceptance "
                f"{stats['acceptance_by_position']}, same {stats['same_as_plain']}",
                file=sys.stderr,
                flush=True,
            )
    report["alone"] = runs
    batch = {"plain": [], "mtp": []}
    plain_texts = None
    for _ in range(args.rounds):
        for name in ("plain", "mtp"):
            wall, texts = batched(model, tokenizer, EVAL_PROMPTS, args.n, head, name == "mtp")
            plain_texts = texts if name == "plain" else plain_texts
            batch[name].append({"wall_s": wall, "same_as_plain": texts == plain_texts})
            print(f"batch 8 {name}: {wall:.1f} s", file=sys.stderr, flush=True)
    report["batch8"] = batch
    report["machine"]["load_after"] = os.getloadavg()[0]
    best = {c: max(r["tok_s"] for r in runs[c]) for c in configs}
    print(f"machine: {report['machine']}")
    for c in configs:
        acc = runs[c][-1]["acceptance_by_position"]
        print(
            f"alone {c:>5}: best {best[c]:6.1f} tok/s ({best[c] / best['plain']:.2f}x plain), "
            f"acceptance by position {[round(a, 3) if a is not None else None for a in acc]}, "
            f"tokens/pass {runs[c][-1]['tokens_per_pass']}"
        )
    bp, bm = (min(r["wall_s"] for r in batch[k]) for k in ("plain", "mtp"))
    print(f"batch 8: plain {bp:.1f} s, mtp {bm:.1f} s ({bp / bm:.2f}x plain)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
