"""Idefics3 / SmolVLM with images against transformers: a tiny random
Idefics3ForConditionalGeneration.

transformers' own processor (``Idefics3Processor`` with ``Idefics3ImageProcessorPil``: LANCZOS
resizes, tiles of the tower's size and a global view) is the reference for ours (pixel values to
the bit, identical input ids) and gives the model's inputs; our SigLIP tower with Idefics3's
positions, the pixel-shuffle connector and the llama network must give its image features, its
logits at every position (f32, within 1e-3) with and without the cache, and its greedy tokens
through ``stream_generate(images=...)``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from gemma3_vlm import random_image
from idefics3_vlm import image_processor, make_idefics3_vlm
from PIL import Image

from mlxinfer.generation import prepare_prompt, stream_generate
from mlxinfer.generation.images import load_images
from mlxinfer.loading.loader import load
from mlxinfer.models.towers.idefics3 import position_ids
from mlxinfer.vision import load_image, load_processor
from mlxinfer.vision.processors import Idefics3Processor

TOL = 1e-3
TEXT = "Describe this image."
SIZES = [(150, 118), (20, 50)]  # 2 x 2 tiles + the global view; 2 x 1 tiles + the global view


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("idefics3_vlm")
    path, torch_model, processor = make_idefics3_vlm(root / "model")
    files = []
    for i, size in enumerate(SIZES):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    model, tokenizer = load(path)
    return path, torch_model, processor, model, tokenizer, files


def _reference_inputs(processor, files):
    content = [{"type": "image"}] * len(files) + [{"type": "text", "text": TEXT}]
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    pictures = [Image.open(f).convert("RGB") for f in files]
    return processor(text=rendered, images=[pictures], return_tensors="pt")


@pytest.mark.parametrize("splitting", [True, False])
@pytest.mark.parametrize("size", [(150, 118), (20, 50), (32, 32), (7, 300), (1, 1), (97, 33)])
def test_frames_match_the_idefics3_pil_processor(vlm, size, splitting):
    path, _, _, _, _, _ = vlm
    ours = load_processor(path)
    assert isinstance(ours, Idefics3Processor)
    if not splitting:
        ours = Idefics3Processor(**{**ours.__dict__, "do_image_splitting": False})
    picture = random_image(5, size) if min(size) > 6 else Image.new("RGB", size, (9, 200, 31))
    theirs = image_processor(do_image_splitting=splitting)(
        [[picture]], return_tensors="np", return_row_col_info=True
    )
    processed = ours.prepare([load_image(picture)])
    expected = theirs["pixel_values"][0]
    assert processed.pixel_values.shape == expected.shape
    assert np.abs(processed.pixel_values - expected).max() <= 1e-6
    frames, rows, cols = processed.grid_thw[0].tolist()
    assert (rows, cols) == (theirs["rows"][0][0], theirs["cols"][0][0]) and frames == len(expected)


def test_input_ids_match_the_idefics3_processor(vlm):
    _, _, processor, model, tokenizer, files = vlm
    batch = _reference_inputs(processor, files)
    images = load_images(model, tokenizer, files)
    assert prepare_prompt(tokenizer, TEXT, images=images) == batch["input_ids"][0].tolist()
    assert images.processed.grid_thw.tolist() == [[5, 2, 2], [3, 2, 1]]


def test_positions_of_a_frame_of_the_tower_s_size_are_the_table_in_order():
    assert position_ids(4, 4, 4).tolist() == list(range(16))
    assert position_ids(26, 26, 26).tolist() == list(range(26 * 26))  # Idefics3's 364 / 14
    assert position_ids(4, 2, 2).tolist() == [0, 2, 8, 10]


def test_image_features_and_logits_match_transformers(vlm):
    _, torch_model, processor, model, _, files = vlm
    batch = _reference_inputs(processor, files)
    pixels = batch["pixel_values"][0].numpy()  # (frames, 3, 32, 32)
    with torch.no_grad():
        expected = torch_model.model.get_image_features(
            batch["pixel_values"], batch["pixel_attention_mask"]
        ).pooler_output
        logits = torch_model(**batch).logits[0].numpy()
    expected = torch.cat(list(expected)).numpy()
    ours = np.array(model.encode_images(mx.array(pixels)))
    assert ours.shape == (8, 4, 32) and expected.shape == (8 * 4, 32)
    assert np.abs(ours.reshape(expected.shape) - expected).max() <= 1e-4
    ids = batch["input_ids"][0].tolist()
    extra = model.image_inputs(ids, mx.array(ours))
    assert np.abs(np.array(model(mx.array([ids]), None, **extra)[0]) - logits).max() <= TOL
    cache, out = model.make_cache(), []
    for start in range(0, len(ids), 7):  # chunks cutting the images: causal attention
        part = extra["embeds"][:, start : start + 7]
        out.append(np.array(model(mx.array([ids[start : start + 7]]), cache, embeds=part)[0]))
    assert np.abs(np.concatenate(out) - logits).max() <= TOL


def _torch_greedy(torch_model, batch, steps: int) -> list[int]:
    ids, out = batch["input_ids"], []
    for _ in range(steps):
        with torch.no_grad():
            logits = torch_model(
                input_ids=ids,
                pixel_values=batch["pixel_values"],
                pixel_attention_mask=batch["pixel_attention_mask"],
            ).logits
        out.append(int(logits[0, -1].argmax()))
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def _tokens(model, tokenizer, files, steps=8):
    results = stream_generate(
        model, tokenizer, TEXT, images=files, chat_template=True, max_tokens=steps
    )
    return [r.token for r in results]


def test_generate_gives_transformers_greedy_tokens(vlm):
    _, torch_model, processor, model, tokenizer, files = vlm
    expected = _torch_greedy(torch_model, _reference_inputs(processor, files), 8)
    assert _tokens(model, tokenizer, files) == expected
    assert _tokens(model, tokenizer, files[1:]) != _tokens(model, tokenizer, files[:1])


def test_convert_keeps_the_tower_float_and_a_stripped_tower_runs_the_text(vlm, tmp_path):
    import mlx.nn as nn
    from safetensors.numpy import load_file, save_file

    from mlxinfer.loading.convert import convert

    path, torch_model, processor, _, _, files = vlm
    expected = _torch_greedy(torch_model, _reference_inputs(processor, files[:1]), 4)
    convert(path, tmp_path / "f32", dtype="float32")
    again, tokenizer = load(tmp_path / "f32")
    assert _tokens(again, tokenizer, files[:1], 4) == expected
    convert(path, tmp_path / "q4", quantize=True, bits=4, group_size=32)
    assert (tmp_path / "q4" / "processor_config.json").is_file()
    quant, tokenizer = load(tmp_path / "q4")
    quantized = [p for p, m in quant.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert any(p.startswith("model.layers.") for p in quantized)
    assert not any(p.startswith(("vision_model", "connector")) for p in quantized)
    import shutil

    shutil.copytree(path, tmp_path / "text")
    weights = load_file(tmp_path / "text" / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if not k.startswith(("model.vision", "model.conn"))},
        tmp_path / "text" / "model.safetensors",
        metadata={"format": "pt"},
    )
    logged: list[str] = []
    text_only, tokenizer = load(tmp_path / "text", log=logged.append)
    assert type(text_only).__module__ == "mlxinfer.models.llama"
    assert "no vision tower" in logged[0]
    ids = tokenizer.encode("What is a cat?")
    with torch.no_grad():
        reference = torch_model(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert np.abs(np.array(text_only(mx.array([ids]))[0]) - reference).max() <= TOL


def test_image_rows_in_the_batching_engine_equal_their_single_runs(vlm):
    """Two image rows (5 and 3 frames) and a text row at once, in chunks of 5 that cut the
    images: their single-run tokens."""
    from mlxinfer.batch import Engine

    _, _, _, model, tokenizer, files = vlm
    asks = [(TEXT, files[:1]), (TEXT, files[1:]), ("What is a cat?", None)]
    single = [
        [
            r.token
            for r in stream_generate(
                model, tokenizer, p, images=i, chat_template=True, max_tokens=6
            )
        ]
        for p, i in asks
    ]
    with Engine(model, block_size=4, prefill_step=5) as engine:
        streams = [
            engine.start(tokenizer, p, images=i, chat_template=True, max_tokens=6) for p, i in asks
        ]
        assert [[r.token for r in s] for s in streams] == single


def test_smolvlm_runs_as_idefics3(tmp_path):
    """SmolVLMForConditionalGeneration (``model_type: smolvlm``): the same network and image
    steps; ids and pixels from our processor (proven equal above), logits within 1e-3 of
    transformers' and its next token through generate."""
    path, torch_model, _ = make_idefics3_vlm(tmp_path, seed=3, family="smolvlm")
    model, tokenizer = load(path)
    assert type(model).__module__ == "mlxinfer.models.idefics3"
    pictures = [random_image(4, (97, 33))]
    images = load_images(model, tokenizer, pictures)
    ids = prepare_prompt(tokenizer, TEXT, images=images)
    pixels = images.processed.pixel_values
    with torch.no_grad():
        expected = torch_model(
            input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pixels[None])
        ).logits[0]
    extra = model.image_inputs(ids, model.encode_images(mx.array(pixels)))
    assert (
        np.abs(np.array(model(mx.array([ids]), None, **extra)[0]) - expected.numpy()).max() <= TOL
    )
    results = stream_generate(
        model, tokenizer, TEXT, images=pictures, chat_template=True, max_tokens=1
    )
    assert [r.token for r in results] == [int(expected[-1].argmax())]
