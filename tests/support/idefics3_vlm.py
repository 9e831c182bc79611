"""A tiny random Idefics3 (SmolVLM) checkpoint, as transformers 5 saves one, with its processor.

``make_idefics3_vlm(path)`` writes ``Idefics3ForConditionalGeneration`` (float32): a SigLIP
tower with Idefics3's positions (32 px frames, 8 px patches: 4 x 4, 2 layers), ``scale_factor`` 2
(4 image tokens per frame), a "llama" text model (2 layers), a byte-level BPE tokenizer holding
Idefics3's special tokens (``<fake_token_around_image>``, ``<image>``, ``<global-img>``, the 36
``<row_r_col_c>``) with the config's ids, a SmolVLM-like chat template, and transformers'
processor (``Idefics3Processor`` with ``Idefics3ImageProcessorPil``: longest edge 64, 32 px
tiles, LANCZOS) saved beside it. Weights are widened so that different images give different
greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from mistral3_vlm import widen, write_tokenizer
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

ROWS_COLS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    *ROWS_COLS,
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
FRAME, PATCH, LONGEST = 32, 8, 64


def image_processor(**overrides) -> Idefics3ImageProcessorPil:
    settings = dict(size={"longest_edge": LONGEST}, max_image_size={"longest_edge": FRAME})
    return Idefics3ImageProcessorPil(**{**settings, **overrides})


def make_idefics3_vlm(path: Path, seed: int = 0, family: str = "idefics3"):
    """Write the checkpoint to ``path``; returns (path, torch model, transformers' processor).

    ``family="smolvlm"``: SmolVLMForConditionalGeneration (SmolVLM2) instead; its Processor
    cannot be built here (its video processor needs torchvision), so the image processor's
    settings are written by hand (SmolVLMImageProcessor: Idefics3's steps) and None returned."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path, SPECIALS, vocab_size=400)
    torch.manual_seed(seed)
    text = dict(
        model_type="llama",
        vocab_size=ids["vocab"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["<end_of_utterance>"],
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=FRAME,
        patch_size=PATCH,
    )
    kind = "SmolVLM" if family == "smolvlm" else "Idefics3"
    config = getattr(transformers, f"{kind}Config")(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<image>"],
        scale_factor=2,
        tie_word_embeddings=False,
    )
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config).eval()
    widen(model)
    model.save_pretrained(path, safe_serialization=True)
    if family == "smolvlm":
        import json

        settings = image_processor().to_dict()
        settings["image_processor_type"] = "SmolVLMImageProcessor"
        processor_config = {"image_processor": settings, "image_seq_len": 4}
        (path / "processor_config.json").write_text(json.dumps(processor_config))
        tokens = {"bos_token": "<s>", "eos_token": "<end_of_utterance>", "unk_token": "<unk>"}
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}
        (path / "tokenizer_config.json").write_text(
            json.dumps({**tokenizer_config, "chat_template": TEMPLATE})
        )
        return path, model, None
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"),
        bos_token="<s>",
        eos_token="<end_of_utterance>",
        unk_token="<unk>",
    )
    processor = transformers.Idefics3Processor(
        image_processor=image_processor(),
        tokenizer=tokenizer,
        image_seq_len=(FRAME // PATCH) ** 2 // 4,
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(path)
    return path, model, processor
