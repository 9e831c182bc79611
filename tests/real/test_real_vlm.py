"""A real image-text checkpoint with an image, against transformers: the prompt ids and the
greedy tokens. No real vision weights can be had where this suite is built, so it is skipped
unless ``MLXINFER_REAL_VLM`` names a checkpoint directory (transformers' layout, as
``hf download`` leaves it): Gemma 3 (``google/gemma-3-4b-it``) or Qwen2.5-VL
(``Qwen/Qwen2.5-VL-3B-Instruct``). Both sides run in float32 (a 4B model needs ~17 GB twice).

    MLXINFER_REAL_VLM=~/models/gemma-3-4b-it python -m pytest -q tests/real/test_real_vlm.py

``MLXINFER_REAL_VLM_IMAGE`` names a picture to use instead of the drawn one (docs/models.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

CHECKPOINT = os.environ.get("MLXINFER_REAL_VLM")
TOKENS = 16
QUESTION = "Describe this image in one sentence."
CLASSES = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


def _picture():
    """The test picture: MLXINFER_REAL_VLM_IMAGE, or a drawn scene (a red disc on blue, a
    yellow square), non-square so that every processor resizes it."""
    from PIL import Image, ImageDraw

    if os.environ.get("MLXINFER_REAL_VLM_IMAGE"):
        return Image.open(os.environ["MLXINFER_REAL_VLM_IMAGE"]).convert("RGB")
    picture = Image.new("RGB", (640, 480), (40, 90, 200))
    draw = ImageDraw.Draw(picture)
    draw.ellipse((80, 120, 320, 360), fill=(220, 30, 30))
    draw.rectangle((400, 160, 560, 320), fill=(240, 220, 40))
    return picture


@pytest.fixture(scope="module")
def checkpoint() -> tuple[Path, str]:
    if not CHECKPOINT:
        pytest.skip(
            "MLXINFER_REAL_VLM is not set: set it to a Gemma 3 or Qwen2.5-VL checkpoint "
            "directory to run this test (no real vision weights here)"
        )
    path = Path(CHECKPOINT).expanduser()
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    if model_type not in CLASSES:
        pytest.skip(f"MLXINFER_REAL_VLM: {model_type} checkpoints are not compared here")
    return path, model_type


def _messages() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def _transformers(path: Path, model_type: str, picture) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and greedy tokens (float32, its own processor)."""
    import torch
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(_messages(), add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[picture], return_tensors="pt")
    model = (
        getattr(transformers, CLASSES[model_type]).from_pretrained(path, dtype=torch.float32).eval()
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids) :].tolist()


def test_greedy_tokens_with_an_image_are_transformers(checkpoint):
    import mlx.core as mx

    from mlxinfer import load, stream_generate
    from mlxinfer.generation.images import load_images
    from mlxinfer.generation.request import prepare_prompt

    path, model_type = checkpoint
    picture = _picture()
    model, tokenizer = load(path, dtype=mx.float32)
    ids = prepare_prompt(tokenizer, _messages(), images=load_images(model, tokenizer, [picture]))
    ours = [
        r.token
        for r in stream_generate(
            model, tokenizer, _messages(), images=[picture], max_tokens=TOKENS, temperature=0
        )
    ]
    del model
    want_ids, want = _transformers(path, model_type, picture)
    assert ids == want_ids
    assert ours[: len(want)] == want, (tokenizer.decode(ours), tokenizer.decode(want))
