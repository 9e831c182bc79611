"""Tiny random transformers checkpoints: the reference for logit parity."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def make_tiny(
    path: Path,
    model_type: str = "llama",
    *,
    config_form: str = "v5",
    seed: int = 0,
    perturb_vectors: bool = False,
    **overrides,
) -> tuple[Path, torch.nn.Module]:
    """Save a random ``model_type`` checkpoint to ``path``; returns (path, torch model).

    ``config_form="v4"`` rewrites config.json the way transformers 4 wrote it
    (``rope_theta`` + ``rope_scaling``) instead of transformers 5's ``rope_parameters``.
    ``perturb_vectors`` also adds noise to 1-D parameters (norm weights, biases),
    which random init leaves at 0 or 1, so that they are exercised too.
    """
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    # Random init has tiny weights; widen them so logits differ meaningfully.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif perturb_vectors:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    if config_form == "v4":
        cfg_path = Path(path) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        params = cfg.pop("rope_parameters", None) or {}
        cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
        kind = params.pop("rope_type", "default")
        cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return Path(path), model


def torch_cache(model: torch.nn.Module) -> transformers.DynamicCache:
    """transformers' cache for ``model``: a hybrid (recurrent layers: LFM2, Qwen3-Next) needs
    its config to know which layers keep a state instead of keys."""
    kinds = set(getattr(model.config, "layer_types", None) or ())
    if kinds - {"full_attention", "sliding_attention"}:
        return transformers.DynamicCache(config=model.config)
    return transformers.DynamicCache()


def torch_logits(model: torch.nn.Module, ids: list[int]):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def torch_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """Greedy decoding of exactly ``n`` tokens with transformers' cached forward (EOS ignored).

    A plain loop rather than ``generate``: generate's EOS handling (stopping, or
    suppressing EOS under ``min_new_tokens``) would change the tokens.
    """
    cache = torch_cache(model)
    out, step = [], list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([step]), cache=cache, use_cache=True).logits
            step = [int(logits[0, -1].argmax())]
            out.append(step[0])
    return out


def torch_logits_chunked(model: torch.nn.Module, chunks: list[list[int]]):
    """transformers' own cached forward, fed chunk by chunk."""
    cache = torch_cache(model)
    outs = []
    with torch.no_grad():
        for chunk in chunks:
            out = model(torch.tensor([chunk]), cache=cache, use_cache=True)
            outs.append(out.logits[0].numpy())
    import numpy as np

    return np.concatenate(outs)


CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "def f(x):\n    return x * 2\n",
    "naïve café — 東京 🙂 12345",
] * 20


def add_tokenizer(path: Path, vocab_size: int = 320) -> Path:
    """Write a small byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json) into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(Path(path) / "tokenizer.json"))
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (Path(path) / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "chat_template": chatml,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return Path(path)
