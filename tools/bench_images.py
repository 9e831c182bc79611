"""An image request joining a running batch (#44's measurement; docs/batching.md "Requests with
images"): ROWS text rows decode in the batching engine; an image request arrives, its image is
encoded by the tower and its prompt prefilled while they keep decoding; then a second turn about
the same image (the encoder cache and the prefix blocks named by the image).

    python tools/bench_images.py [--rows 8] [--seconds 6] [--no-hold-windows]

Prints the text rows' decode rate (tokens/s, all rows together, and the longest gap between two
of a row's tokens) before the image request, during its encoding and prefill (submit to its
first token), and after; and each turn's time to first token with its cached prompt tokens and
the encoder's calls and cache hits. No real vision weights can be had here: the checkpoint is
built in a temporary directory with random weights by transformers (Gemma3ForConditionalGeneration,
float32): a SigLIP tower of 12 layers x 384 at 224 px (256 patches, 64 soft tokens per image) and
a Gemma 3 text model of 12 layers x 768 (~105M parameters, vocabulary 32,768). Its numbers are
the engine's scheduling, not any real model's speed.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlxinfer  # noqa: F401  (before mlx: the fast BLAS)
import numpy as np

IMAGE, PATCH, SOFT_TOKENS = 224, 14, 64
VOCAB = 32_768
PROMPT = "Describe this image in detail."


def build(path: Path) -> Path:
    """The random-weight Gemma 3 image-text checkpoint (tokenizer, processor, weights)."""
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from gemma3_vlm import TEMPLATE, write_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))  # padded to VOCAB, as Gemma's unused
    tok.add_special_tokens([f"<unused{i}>" for i in range(VOCAB - tok.get_vocab_size())])
    tok.save(str(path / "tokenizer.json"))
    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=512,
        max_position_embeddings=8192,
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<end_of_turn>"],
        pad_token_id=ids["<pad>"],
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=6,
        image_size=IMAGE,
        patch_size=PATCH,
        vision_use_head=False,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=SOFT_TOKENS,
        image_token_index=ids["<image_soft_token>"],
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(
            size={"height": IMAGE, "width": IMAGE}
        ),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        image_seq_length=SOFT_TOKENS,
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(path)
    text_params = sum(p.numel() for n, p in model.named_parameters() if "language_model" in n)
    tower_params = sum(p.numel() for n, p in model.named_parameters() if "vision" in n)
    print(f"checkpoint: text {text_params / 1e6:.0f}M, tower {tower_params / 1e6:.1f}M parameters")
    return path


def picture(path: Path, seed: int) -> Path:
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    Image.fromarray(small).resize((640, 480), Image.Resampling.BILINEAR).save(path)
    return path


class Rows:
    """ROWS text requests decoding without end (token ids, no EOS), each token's time kept."""

    def __init__(self, engine, rows: int, vocab: int) -> None:
        rng = np.random.default_rng(1)
        self.times: list[list[float]] = [[] for _ in range(rows)]
        self.handles = [
            engine.submit(rng.integers(400, vocab, 64).tolist(), max_tokens=2000)
            for _ in range(rows)
        ]
        self.threads = [
            threading.Thread(target=self._read, args=(h, t), daemon=True)
            for h, t in zip(self.handles, self.times)
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _read(handle, times: list[float]) -> None:
        for _ in handle.steps(timeout=600):
            times.append(time.perf_counter())

    def window(self, start: float, end: float) -> dict:
        """The rows' tokens/s in [start, end) and the longest gap between a row's tokens."""
        count = sum(1 for ts in self.times for t in ts if start <= t < end)
        gaps = [b - a for ts in self.times for a, b in zip(ts, ts[1:]) if start <= b < end + 1e-9]
        return {
            "seconds": round(end - start, 2),
            "tokens_per_s": round(count / (end - start), 1),
            "per_row_tokens_per_s": round(count / (end - start) / len(self.times), 2),
            "median_gap_ms": round(statistics.median(gaps) * 1000, 1) if gaps else None,
            "longest_gap_ms": round(max(gaps) * 1000, 1) if gaps else None,
        }

    def close(self) -> None:
        for h in self.handles:
            h.cancel()
        for t in self.threads:
            t.join(30)


def turn(engine, tokenizer, messages: list[dict]) -> dict:
    """One image request through the engine: submit to first token, and its reply."""
    before = engine.metrics()
    t0 = time.perf_counter()
    stream = engine.start(tokenizer, messages, max_tokens=12, chat_template=True, timeout=600)
    first = next(stream)
    t_first = time.perf_counter()
    text = first.text + "".join(r.text for r in stream)
    after = engine.metrics()
    return {
        "submitted": t0,
        "first_token": t_first,
        "ttft_s": round(t_first - t0, 3),
        "prompt_tokens": first.stats.prompt_tokens,
        "cached_tokens": stream.handle.cached_tokens,
        "encoder_calls": after["image_encoder_calls"] - before["image_encoder_calls"],
        "encoder_cache_hits": after["image_encoder_cache_hits"]
        - before["image_encoder_cache_hits"],
        "reply": text,
    }


def unit_costs(model, tokenizer, image: Path, messages: list[dict]) -> dict:
    """What the engine schedules for an image request, each timed alone (median of 3): the
    tower and projector on the image, and the prompt's prefill (one forward, fresh cache)."""
    import mlx.core as mx

    from mlxinfer.cache.prompt import PromptCache
    from mlxinfer.generation.images import (
        image_inputs,
        images_in_messages,
        load_images,
        prefill_images,
    )
    from mlxinfer.generation.request import prepare_prompt

    marked, sources = images_in_messages(messages)
    images = load_images(model, tokenizer, sources)
    ids = prepare_prompt(tokenizer, marked, images=images)
    pixels = mx.array(images.processed.pixel_values)

    def timed(fn) -> float:
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        return round(statistics.median(runs), 3)

    inputs = image_inputs(model, ids, images)  # the tower once, outside the timing
    mx.eval(inputs)

    def prefill() -> None:
        cache = PromptCache(model.make_cache())
        prefill_images(model, cache, ids, inputs, 512)

    return {
        "tower_s": timed(lambda: mx.eval(model.encode_images(pixels))),
        "prefill_s": timed(prefill),
        "prompt_tokens": len(ids),
    }


def machine() -> str:
    cpu = "?"
    try:
        import subprocess

        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line
        )
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} CPUs, load average {load}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=6.0, help="each window before/after")
    parser.add_argument(
        "--no-hold-windows",
        action="store_true",
        help="Engine(hold_windows=False): the sliding layers' keys in the one pool",
    )
    args = parser.parse_args()
    from mlxinfer.batch import Engine

    print("machine:", machine())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = build(root / "gemma3-random")
        model, tokenizer = mlxinfer.load(path)
        image, other = picture(root / "a.png", 1), picture(root / "b.png", 2)
        first = [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": str(image)},
                    {"type": "text", "text": PROMPT},
                ],
            }
        ]
        options = {"hold_windows": False} if args.no_hold_windows else {}
        with Engine(model, max_batch=args.rows + 1, **options) as engine:
            warm = [{"role": "user", "content": [{"type": "image", "image": str(other)}, "x"]}]
            warm[0]["content"][1] = {"type": "text", "text": "Warm up."}
            turn(engine, tokenizer, warm)  # the tower and the shapes once, another image
            rows = Rows(engine, args.rows, VOCAB)
            while min(len(t) for t in rows.times) < 3:
                time.sleep(0.05)
            t0 = time.perf_counter()
            time.sleep(args.seconds)
            one = turn(engine, tokenizer, first)
            time.sleep(args.seconds)
            second_messages = first + [
                {"role": "assistant", "content": one["reply"]},
                {"role": "user", "content": "What colors does it have?"},
            ]
            two = turn(engine, tokenizer, second_messages)
            time.sleep(args.seconds)
            t_end = time.perf_counter()
            rows.close()
        windows = {
            "before": rows.window(t0, one["submitted"]),
            "during_first_turn_encode_and_prefill": rows.window(
                one["submitted"], one["first_token"]
            ),
            "after_first_turn": rows.window(one["first_token"], two["submitted"]),
            "during_second_turn_prefill": rows.window(two["submitted"], two["first_token"]),
            "after_second_turn": rows.window(two["first_token"], t_end),
        }
        alone = unit_costs(model, tokenizer, image, first)
        turns = {
            name: {k: v for k, v in t.items() if k not in ("submitted", "first_token", "reply")}
            for name, t in (("first_turn", one), ("second_turn_same_image", two))
        }
        report = {
            "machine": machine(),
            "rows": args.rows,
            "hold_windows": not args.no_hold_windows,
            "windows": windows,
            "turns": turns,
            "alone_no_other_rows": alone,
        }
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
