"""Speculative decoding benchmark: plain decoding vs each draft source vs mlx-lm's speculative decoding.

One process, one machine, one input-grounded prompt (rewrite a 40-line Python
function with type hints, keeping its logic), greedy, EOS ignored so every run
yields exactly ``max_tokens`` tokens. Pairs (SmolLM2-135M-Instruct, from the
transformers checkpoint in tests/fixtures.py):

- target: ``mlxinfer.convert`` at float32;
- draft model: ``mlxinfer.convert`` 4-bit (group 64, float32 scales) of the
  same checkpoint, loaded by both engines;
- self-draft: the f32 target's own first N layers;
- prompt lookup: no draft model.

How it times: the prompt is prefilled into each run's caches (target and
draft) outside the timer, so the numbers are decode only: tokens/s = tokens
/ (time from the generator's start to its last token). Each configuration runs
once after a short warm-up; the speedup is against mlxinfer's plain decoding.
Greedy speculative output must equal plain greedy output ("same" column).

    python tools/bench_speculative.py                  # 256 new tokens
    python tools/bench_speculative.py -n 64 --json out.json

mlx-lm is a reference peer: this tool may import it, ``mlxinfer`` never does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from mlxinfer.platform.blas import blas_in_use, preload_openblas  # noqa: E402

preload_openblas()  # before the first `import mlx`

import mlx.core as mx  # noqa: E402

FUNCTION = '''\
def summarize_orders(orders, min_total, currency):
    """Group orders by customer and report totals above a threshold."""
    by_customer = {}
    skipped = 0
    for order in orders:
        if order.get("status") == "cancelled":
            skipped += 1
            continue
        customer = order["customer"]
        amount = order["amount"]
        if order.get("currency", currency) != currency:
            rate = order.get("rate", 1.0)
            amount = amount * rate
        entry = by_customer.setdefault(customer, {"count": 0, "total": 0.0, "items": []})
        entry["count"] += 1
        entry["total"] += amount
        for item in order.get("items", []):
            if item not in entry["items"]:
                entry["items"].append(item)
    report = []
    for customer, entry in sorted(by_customer.items()):
        if entry["total"] < min_total:
            continue
        average = entry["total"] / entry["count"]
        line = {
            "customer": customer,
            "orders": entry["count"],
            "total": round(entry["total"], 2),
            "average": round(average, 2),
            "items": sorted(entry["items"]),
        }
        report.append(line)
    report.sort(key=lambda line: line["total"], reverse=True)
    summary = {
        "currency": currency,
        "customers": len(report),
        "skipped": skipped,
        "grand_total": round(sum(line["total"] for line in report), 2),
    }
    return report, summary
'''
MESSAGES = [
    {"role": "system", "content": "You are a precise code assistant. Reply with code only."},
    {
        "role": "user",
        "content": "Add type hints to this Python function. Change nothing else: copy every "
        f"other line exactly as it is.\n\n```python\n{FUNCTION}```",
    },
]

TokenFn = Callable[
    [], Iterator[tuple[int, bool]]
]  # -> (token, from_draft) for exactly max_tokens tokens
Prepare = Callable[
    [list[int]], TokenFn
]  # prompt ids -> prefill fresh caches (untimed), return what to time


@dataclass
class Result:
    name: str
    engine: str
    draft: str
    tokens_per_s: float
    speedup: float
    acceptance: float | None  # accepted / drafted (None: not reported by this engine)
    tokens_per_step: float | None  # tokens per target forward pass
    from_draft: int  # tokens that came from the draft
    same_as_plain: bool
    tokens: list[int]


def convert_models(work: Path) -> tuple[Path, Path]:
    from fixtures import smollm2_hf_dir

    from mlxinfer.loading.convert import convert

    hf = smollm2_hf_dir()
    target, draft = work / "smollm2-f32", work / "smollm2-4bit"
    convert(hf, target, dtype="float32")
    # float32 scales and activations: MLX's CPU backend computes float16 ~20x slower than float32
    convert(hf, draft, quantize=True, bits=4, group_size=64, dtype="float32")
    return target, draft


# ---------------------------------------------------------------- configurations


def ours(target_dir: Path, draft_dir: Path, n: int):
    """mlxinfer: name -> (draft description, prepare, GenerationStats the run fills or None)."""
    import mlxinfer
    from mlxinfer.cache.prompt import PromptCache
    from mlxinfer.generation import GenerationStats, generate_step
    from mlxinfer.generation.drafts import DraftModel, PromptLookup, SelfDraft
    from mlxinfer.generation.prefill import prefill
    from mlxinfer.generation.speculative import speculative_generate_step

    model, _ = mlxinfer.load(target_dir)
    draft, _ = mlxinfer.load(draft_dir)
    mx.eval(
        model.parameters(), draft.parameters()
    )  # weights are mapped lazily: load them before timing
    L = len(model.layers)

    prefilled_caches: dict[tuple[int, tuple[int, ...]], PromptCache] = {}

    def prefilled(m, ids) -> PromptCache:
        """A cache holding ``ids[:-1]``, filled once per model and prompt: every run starts by
        trimming it back to the prompt (``PromptCache.reuse``), so 4-bit prefill on CPU
        (slow: ~0.1 s a token here) happens once, not once per run."""
        key = (id(m), tuple(ids))
        if key not in prefilled_caches:
            pc = PromptCache(m.make_cache())
            prefill(m, pc, ids[:-1], 512)
            prefilled_caches[key] = pc
        return prefilled_caches[key]

    def plain(ids) -> TokenFn:
        pc = prefilled(model, ids)
        return lambda: (
            (t, False) for t, _ in generate_step(ids, model, prompt_cache=pc, max_tokens=n)
        )

    def speculative(make_draft, num_draft, stats):
        def prepare(ids) -> TokenFn:
            pc, source = prefilled(model, ids), make_draft(ids)
            for f in ("draft_tokens", "accepted_tokens", "speculative_steps"):
                setattr(stats, f, 0)

            def run():
                steps = speculative_generate_step(
                    ids, model, source, prompt_cache=pc, max_tokens=n, num_draft=num_draft
                )
                for step in steps:
                    stats.count(step)  # the loop reports its counts in what it yields
                    yield step.token, step.from_draft

            return run

        return prepare

    def draft_model(ids):
        return DraftModel(draft, prompt_cache=prefilled(draft, ids))

    configs = {"plain": ("–", plain, None)}
    for name, desc, make, k in [
        ("prompt lookup", "n-grams 3…1 of prompt + output", lambda ids: PromptLookup(), None),
        ("self-draft 12", f"first 12 of {L} layers", lambda ids: SelfDraft(12), None),
        ("self-draft 24", f"first 24 of {L} layers", lambda ids: SelfDraft(24), None),
        ("draft model, k=2", "4-bit SmolLM2-135M", draft_model, 2),
        ("draft model, adaptive k", "4-bit SmolLM2-135M", draft_model, None),
    ]:
        stats = GenerationStats()
        configs[name] = (desc, speculative(make, k, stats), stats)
    return configs


def theirs(target_dir: Path, draft_dir: Path, n: int):
    """mlx-lm: plain decoding, and its speculative decoding with the same 4-bit draft (k=2, its default)."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    gen = importlib.import_module(
        "mlx_lm.generate"
    )  # the package re-binds `generate` to a function
    model, _ = mlx_lm.load(str(target_dir))
    draft, _ = mlx_lm.load(str(draft_dir))
    mx.eval(model.parameters(), draft.parameters())

    prefilled_caches: dict[tuple[int, tuple[int, ...]], list] = {}

    def prefilled(m, prompt):
        """As for mlxinfer: filled once, trimmed back to the prompt before each run."""
        key = (id(m), tuple(prompt.tolist()))
        if key not in prefilled_caches:
            cache = make_prompt_cache(m)
            m(prompt[None, :-1], cache)
            mx.eval([c.state for c in cache])
            prefilled_caches[key] = cache
        cache = prefilled_caches[key]
        trim_prompt_cache(cache, cache[0].offset - (prompt.size - 1))
        return cache

    def plain(ids) -> TokenFn:
        prompt = mx.array(ids)
        cache = prefilled(model, prompt)
        return lambda: (
            (t, False)
            for t, _ in gen.generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=n)
        )

    def speculative(ids) -> TokenFn:
        prompt = mx.array(ids)
        cache = prefilled(model, prompt) + prefilled(
            draft, prompt
        )  # the target's layers, then the draft's
        return lambda: (
            (t, f)
            for t, _, f in gen.speculative_generate_step(
                prompt[-1:], model, draft, prompt_cache=cache, num_draft_tokens=2, max_tokens=n
            )
        )

    return {
        "mlx-lm plain": ("–", plain, None),
        "mlx-lm speculative, k=2": ("4-bit SmolLM2-135M", speculative, None),
    }


# ---------------------------------------------------------------- timing


def time_run(prepare: Prepare, ids: list[int], n: int) -> tuple[float, list[int], int]:
    """Decode-only tokens/s: caches are prefilled by ``prepare``, outside the timer."""
    start = prepare(ids)
    mx.synchronize()
    out, drafted = [], 0
    t0 = time.perf_counter()
    steps = start()
    for token, from_draft in steps:
        out.append(int(token))  # a Python int: its step has finished
        drafted += bool(from_draft)
    t = time.perf_counter() - t0
    steps.close()
    mx.synchronize()
    if len(out) != n:
        raise RuntimeError(f"expected {n} tokens, got {len(out)}")
    return n / t, out, drafted


def warm_up(prepare: Prepare, ids: list[int], n: int) -> None:
    """A short run on the prompt's last 32 tokens (4-bit prefill of the whole prompt is slow on CPU)."""
    steps = prepare(ids[-32:])()
    for _ in zip(range(n), steps):
        pass
    steps.close()


def measure(max_tokens: int, log: Callable[[str], None]) -> dict:
    import mlxinfer

    with tempfile.TemporaryDirectory() as work:
        log("converting SmolLM2-135M-Instruct: f32 target, 4-bit draft")
        target_dir, draft_dir = convert_models(Path(work))
        _, tokenizer = mlxinfer.load(target_dir)
        ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
        configs = {
            **ours(target_dir, draft_dir, max_tokens),
            **theirs(target_dir, draft_dir, max_tokens),
        }
        results: list[Result] = []
        plain_tps = plain_tokens = None
        for name, (desc, prepare, stats) in configs.items():
            log(f"  {name}: warm-up, then {max_tokens} tokens")
            warm_up(prepare, ids, min(8, max_tokens))
            tps, tokens, from_draft = time_run(prepare, ids, max_tokens)
            if name == "plain":
                plain_tps, plain_tokens = tps, tokens
            acceptance = tokens_per_step = None
            if stats is not None:
                acceptance = stats.acceptance_rate
                tokens_per_step = max_tokens / stats.speculative_steps
            results.append(
                Result(
                    name,
                    "mlx-lm" if name.startswith("mlx-lm") else "mlxinfer",
                    desc,
                    tps,
                    tps / plain_tps,
                    acceptance,
                    tokens_per_step,
                    from_draft,
                    tokens == plain_tokens,
                    tokens,
                )
            )
            log(
                f"    {tps:.1f} tok/s, {tps / plain_tps:.2f}x plain, {from_draft} tokens from the draft"
            )
        text = tokenizer.decode(plain_tokens)
    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "blas": blas_in_use(),
            "mlx": mx.__version__,
            "device": str(mx.default_device()),
            "load_average": os.getloadavg(),
        },
        "target": "SmolLM2-135M-Instruct float32 (mlxinfer.convert)",
        "draft_model": "SmolLM2-135M-Instruct 4-bit group 64, float32 scales (mlxinfer.convert)",
        "prompt_tokens": len(ids),
        "max_tokens": max_tokens,
        "plain_output": text,
        "results": [asdict(r) for r in results],
    }


def table(report: dict) -> str:
    rows = [
        "| run | draft | tok/s | speedup | acceptance | tokens/step | from draft | same tokens as plain |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "–"
        tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] is not None else "–"
        rows.append(
            f"| {r['name']} | {r['draft']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {acc} | "
            f"{tps} | {r['from_draft']}/{report['max_tokens']} | {'yes' if r['same_as_plain'] else 'no'} |"
        )
    m = report["machine"]
    rows.append("")
    rows.append(
        f"{report['prompt_tokens']}-token prompt, {report['max_tokens']} new tokens, greedy; target "
        f"{report['target']}; draft model {report['draft_model']}. {m['processor']}, {m['cpus']} CPUs, "
        f"MLX {m['mlx']} on {m['device']}, BLAS {m['blas']}; load average {m['load_average'][0]:.1f}."
    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--max-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, help="also write the full report here")
    args = parser.parse_args()
    report = measure(args.max_tokens, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
