"""A tiny llama checkpoint written by mlxinfer itself (no torch: milliseconds), for the tests of
what hostile files do: config.json, model.safetensors, tokenizer.json + tokenizer_config.json."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxinfer.models import build_model

VOCAB = 300
CONFIG = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}
CORPUS = ["Hello world, the quick brown fox jumps over the lazy dog.", "naïve café 東京 🙂"] * 20


def tokenizer_json(vocab_size: int = VOCAB, bos_id: int | None = None) -> dict:
    """A byte-level BPE tokenizer.json of at most ``vocab_size`` ids; with ``bos_id``, its
    post-processor adds ``<s>`` (id 0, or ``bos_id`` as the added token's id) before the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos_id is not None:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    data = json.loads(tok.to_str())
    if bos_id is not None and bos_id != 0:  # <s> given another id: a hostile file's
        for token in data["added_tokens"]:
            if token["content"] == "<s>":
                token["id"] = bos_id
        data["post_processor"]["special_tokens"]["<s>"]["ids"] = [bos_id]
        data["model"]["vocab"]["<s>"] = bos_id
    return data


def write_checkpoint(path: Path, *, tokenizer: dict | None = None, **overrides) -> Path:
    """config.json (``CONFIG`` with ``overrides``), random weights, and a tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**CONFIG, **overrides}
    mx.random.seed(0)
    model = build_model(config)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(json.dumps(tokenizer or tokenizer_json()))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return path


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    """A safetensors file: the header's length, the header as JSON, the data."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data
