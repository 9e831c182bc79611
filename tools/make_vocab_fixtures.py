"""Freeze llama.cpp's tokenization of byte-level BPE GGUF vocabularies, one per pre-tokenizer.

    python tools/make_vocab_fixtures.py --llama-python VENV/bin/python

llama.cpp splits text before BPE by the regexes its ``tokenizer.ggml.pre`` names
(src/llama-vocab.cpp), adapted from each model's own tokenizer.json. mlxinfer rebuilds that
tokenizer.json (mlxinfer/gguf/vocab.py); this tool records what llama.cpp makes of the same
vocabulary, as the reference: a byte-level BPE vocabulary is trained here (``tokenizers``,
2,000 merges over the shipped calibration corpus, split by GPT-2's regex), written as a
vocabulary-only GGUF once per pre-tokenizer name, and each file is loaded by llama-cpp-python
(``vocab_only``; the interpreter named by --llama-python, built as docs/quality.md says) to
tokenize texts made to tell the splits apart (contractions, digit runs, CJK and kana, combining
marks, punctuation before letters, newlines and trailing spaces) and a slice of the evaluation
corpus. Written: ``tests/fixtures/gguf/vocab_pre.json`` (the vocabulary, the texts, and per
name llama.cpp's ids); tests/gguf/test_gguf_vocab_pre.py compares mlxinfer's tokenizer with it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "gguf" / "vocab_pre.json"
PRES = ("gpt-2", "smollm", "qwen2", "qwen35", "llama-bpe", "lfm2", "dbrx", "glm4", "gpt-4o",
        "tekken", "deepseek-v3", "deepseek-llm", "starcoder")  # fmt: skip
TEXTS = [
    "I'm sure they'll say it's fine, don't you THINK'S? We'd've gone.",
    "Numbers: 1 12 123 1234 12345 3.14159 2026-12-06 ¹²³ ٣٤٥",
    "東京は日本の首都です。カタカナとひらがな、漢字。한국어 텍스트도 있어요.",
    "naïve café — combining: nai\u0308ve cafe\u0301, Zoë, Ångström",
    "www.example.com/path?x=1&y=2 (see: [docs]) {code} <tag> @user #tag $5 50% a+b=c",
    "line one\nline two\r\n\n\n   indented\ttab   \n  trailing spaces   ",
    "def f(x):\n    return x**2  # square\n\nprint(f(12))",
    "Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم 🙂🚀 emoji",
    "HelloWorld CamelCaseWord iPhone McDonald's xoWz qoWv",
]
# Merges added after the trained ones (byte-level spellings), so that a split shows in the ids:
# "i" + U+0308 (qwen35 keeps a letter's combining marks in its piece, qwen2 does not) and
# "o" + "W" (gpt-4o splits before a capital, Llama 3 does not).
EXTRA_MERGES = ["\u00cc \u012a", "i \u00cc\u012a", "o W"]


def train_vocab(corpus: str) -> tuple[list[str], list[str]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=256 + 2000,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator([corpus], trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    for merge in EXTRA_MERGES:
        joined = merge.replace(" ", "")
        if joined not in tokens:
            tokens.append(joined)
        if merge not in merges:
            merges.append(merge)
    return tokens, merges


def write_vocab_gguf(path: Path, pre: str, tokens: list[str], merges: list[str]) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(merges)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


LLAMA_SIDE = """
import json, sys
import llama_cpp
path, texts = sys.argv[1], json.loads(sys.stdin.read())
llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
print(json.dumps([llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    texts_dir = ROOT / "mlxinfer" / "quant" / "texts"

    def records(name: str) -> list[dict]:  # entries with a "file" hold no text inline
        lines = (texts_dir / name).read_text().splitlines()
        return [r for r in map(json.loads, filter(str.strip, lines)) if "text" in r]

    corpus = "\n".join(r["text"] for r in records("calibration.jsonl"))
    # one piece of each kind of the evaluation corpus (its languages, code, maths, JSON)
    evaluation = [r["text"][:300] for r in records("evaluation.jsonl")[::3]]
    texts = TEXTS + evaluation
    tokens, merges = train_vocab(corpus)
    ids = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRES:
            path = Path(tmp) / f"{pre}.gguf"
            write_vocab_gguf(path, pre, tokens, merges)
            run = subprocess.run(
                [args.llama_python, "-c", LLAMA_SIDE, str(path)],
                input=json.dumps(texts), capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if run.returncode:
                sys.exit(f"llama-cpp-python failed on {pre}: {run.stderr[-2000:]}")
            ids[pre] = json.loads(run.stdout)
    version = subprocess.run(
        [args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    fixture = {
        "made_by": f"llama-cpp-python {version} (tools/make_vocab_fixtures.py)",
        "tokens": tokens,
        "merges": merges,
        "texts": texts,
        "ids": ids,
    }
    args.out.write_text(json.dumps(fixture, ensure_ascii=False, indent=None) + "\n")
    print(args.out, args.out.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
