"""Speculative decoding from Python: the same text, fewer passes of the big model.

    python examples/speculative.py [MODEL_DIR_OR_REPO] [DRAFT_MODEL_DIR_OR_REPO]

Rewrites a small function with type hints three ways: plain decoding, prompt
lookup (drafts copied from the prompt: no second model), and, when a draft model
is given, that model drafting. Greedy, so every run prints the same text; what
changes is how many tokens each pass of the model yields.
"""

from __future__ import annotations

import sys

from mlxinfer.platform.blas import preload_openblas

preload_openblas()  # Linux only, before MLX loads

import mlxinfer  # noqa: E402

CODE = """def mean_by_key(rows, key):
    totals = {}
    counts = {}
    for row in rows:
        k = row[key]
        totals[k] = totals.get(k, 0) + row["value"]
        counts[k] = counts.get(k, 0) + 1
    return {k: totals[k] / counts[k] for k in totals}
"""


def run(model, tokenizer, label: str, max_tokens: int, **options) -> str:
    prompt = [
        {
            "role": "user",
            "content": f"Add type hints to this function, keeping its logic:\n\n{CODE}",
        }
    ]
    results = list(
        mlxinfer.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **options)
    )
    s = results[-1].stats
    extra = (
        f", {s.acceptance_rate:.0%} of drafts accepted, {s.tokens_per_step:.2f} tokens per pass"
        if s.speculative_steps
        else ""
    )
    print(
        f"[{label}] {s.generation_tokens} tokens at {s.decode_tps:.1f} tok/s{extra}",
        file=sys.stderr,
    )
    return "".join(r.text for r in results)


def main(
    model_path: str | None = None, draft_path: str | None = None, max_tokens: int = 120
) -> None:
    model, tokenizer = mlxinfer.load(model_path)
    plain = run(model, tokenizer, "plain", max_tokens)
    print(plain)
    assert (
        run(model, tokenizer, "prompt lookup", max_tokens, draft=mlxinfer.PromptLookup()) == plain
    )
    if draft_path is not None:
        draft = mlxinfer.DraftModel(*mlxinfer.load(draft_path))  # must share the tokenizer: checked
        assert run(model, tokenizer, "draft model", max_tokens, draft=draft) == plain


if __name__ == "__main__":
    main(*sys.argv[1:3])
