"""Mistral 3 with images against transformers: a tiny random Mistral3ForConditionalGeneration.

Pixel values and input ids come from mlxinfer's Pixtral processor (test_processors.py proves
them equal to transformers' ``PixtralImageProcessorPil`` + ``PixtralProcessor``, which cannot
be built here: its module imports torchvision). Our Pixtral tower and projector must give
transformers' image features for two images of different sizes in one call, its logits at every
position (f32, within 1e-3) with and without the cache, and its greedy tokens, through the model
and through ``stream_generate(images=...)``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from gemma3_vlm import random_image
from mistral3_vlm import PATCH, make_mistral3_vlm

from mlxinfer.generation import prepare_prompt, stream_generate
from mlxinfer.generation.images import load_images
from mlxinfer.loading.loader import load

TOL = 1e-3
TEXT = "Describe this image."
SIZES = [(150, 118), (150, 60)]  # 64 x 64 and 64 x 32 px after the resize: 8x8 and 4x8 patches


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral3_vlm")
    path, torch_model = make_mistral3_vlm(root / "model")
    files = []
    for i, size in enumerate(SIZES):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    model, tokenizer = load(path)
    return path, torch_model, model, tokenizer, files


def _inputs(model, tokenizer, files):
    images = load_images(model, tokenizer, files)
    ids = prepare_prompt(tokenizer, TEXT, images=images)
    processed = images.processed
    return ids, processed.pixel_values, processed.grid_thw


def _torch_kwargs(ids, pixels, grids):
    sizes = torch.tensor(np.asarray(grids)[:, 1:] * PATCH)  # image_sizes: (height, width) px
    return dict(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pixels), image_sizes=sizes)


def _reference(torch_model, ids, pixels, grids) -> np.ndarray:
    with torch.no_grad():
        return torch_model(**_torch_kwargs(ids, pixels, grids)).logits[0].numpy()


def _ours(model, ids, pixels, grids, cache=None, chunk=None) -> np.ndarray:
    extra = model.image_inputs(ids, model.encode_images(mx.array(pixels), grids))
    if chunk is None:
        return np.array(model(mx.array([ids]), cache, **extra)[0])
    out = []
    for start in range(0, len(ids), chunk):
        end = start + chunk
        part = model(mx.array([ids[start:end]]), cache, embeds=extra["embeds"][:, start:end])
        out.append(np.array(part[0]))
    return np.concatenate(out)


def test_the_model_loads_with_its_tower(vlm):
    _, _, model, _, _ = vlm
    assert type(model).__module__ == "mlxinfer.models.mistral3"
    assert model.vision_tower.patch_conv.weight.shape == (32, PATCH, PATCH, 3)
    assert model.multi_modal_projector.patch_merger.merging_layer.weight.shape == (32, 128)


def test_image_features_of_two_sizes_match_transformers(vlm):
    _, torch_model, model, tokenizer, files = vlm
    ids, pixels, grids = _inputs(model, tokenizer, files)
    assert grids.tolist() == [[1, 8, 8], [1, 4, 8]]
    kwargs = _torch_kwargs(ids, pixels, grids)
    with torch.no_grad():
        expected = torch_model.model.get_image_features(
            kwargs["pixel_values"], kwargs["image_sizes"]
        ).pooler_output
    expected = torch.cat(expected).numpy()
    ours = np.array(model.encode_images(mx.array(pixels), grids))
    assert ours.shape == expected.shape == (16 + 8, 32)
    assert np.abs(ours - expected).max() <= 1e-4
    # Each image alone gives its own rows: the images of one call never see each other.
    alone = np.array(model.encode_images(mx.array(pixels[1:, :, :32]), grids[1:]))
    assert np.abs(alone - ours[16:]).max() <= 1e-4


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_match_at_every_position(vlm, n_images):
    _, torch_model, model, tokenizer, files = vlm
    ids, pixels, grids = _inputs(model, tokenizer, files[:n_images])
    expected = _reference(torch_model, ids, pixels, grids)
    assert np.abs(_ours(model, ids, pixels, grids) - expected).max() <= TOL
    # Chunks of 7 cut the images anywhere: image tokens attend causally, as text does.
    chunked = _ours(model, ids, pixels, grids, model.make_cache(), chunk=7)
    assert np.abs(chunked - expected).max() <= TOL


def _torch_greedy(torch_model, ids, pixels, grids, steps: int) -> list[int]:
    kwargs = _torch_kwargs(ids, pixels, grids)
    out = []
    for _ in range(steps):
        with torch.no_grad():
            token = int(torch_model(**kwargs).logits[0, -1].argmax())
        out.append(token)
        kwargs["input_ids"] = torch.cat([kwargs["input_ids"], torch.tensor([[token]])], dim=1)
    return out


def _our_greedy(model, ids, pixels, grids, steps: int) -> list[int]:
    extra = model.image_inputs(ids, model.encode_images(mx.array(pixels), grids))
    cache = model.make_cache()
    logits = model(mx.array([ids]), cache, **extra)
    out = []
    for _ in range(steps):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache)
    return out


def test_greedy_tokens_match_with_the_kv_cache_and_through_generate(vlm):
    _, torch_model, model, tokenizer, files = vlm
    ids, pixels, grids = _inputs(model, tokenizer, files)
    expected = _torch_greedy(torch_model, ids, pixels, grids, 8)
    assert _our_greedy(model, ids, pixels, grids, 8) == expected
    results = stream_generate(
        model, tokenizer, TEXT, images=files, chat_template=True, max_tokens=8
    )
    assert [r.token for r in results] == expected


def test_different_images_give_different_tokens(vlm):
    """The checkpoint is not blind to its images (else the tests above could pass with the
    image ignored)."""
    _, _, model, tokenizer, files = vlm
    a = _our_greedy(model, *_inputs(model, tokenizer, files[:1]), 8)
    b = _our_greedy(model, *_inputs(model, tokenizer, [random_image(99, SIZES[0])]), 8)
    assert a != b


def test_ministral3_text_and_an_earlier_feature_layer(tmp_path):
    """Ministral 3's text model (Llama 4's query scaling, past 16 positions here) under the
    same tower, reading the second-to-last block's states (``vision_feature_layer`` -2)."""
    path, torch_model = make_mistral3_vlm(tmp_path, "ministral3", seed=1, feature_layer=-2)
    model, tokenizer = load(path)
    assert model.args.text_model_type == "ministral3" and model.args.llama_4_scaling_beta
    files = [random_image(3, SIZES[1])]
    ids, pixels, grids = _inputs(model, tokenizer, files)
    assert len(ids) > 16
    expected = _reference(torch_model, ids, pixels, grids)
    assert np.abs(_ours(model, ids, pixels, grids) - expected).max() <= TOL


def test_the_hub_layout_of_the_weights_loads_too(vlm, tmp_path):
    """transformers 4's names (the released checkpoints'): ``language_model.model.*``,
    ``language_model.lm_head.*``, ``vision_tower.*``, ``multi_modal_projector.*``."""
    import shutil

    from safetensors.numpy import load_file, save_file

    path, torch_model, model, tokenizer, files = vlm
    for f in path.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    renamed = {}
    for key, value in load_file(path / "model.safetensors").items():
        key = key.replace("model.language_model.", "language_model.model.")
        if key.startswith("lm_head."):
            key = "language_model." + key
        key = key.replace("model.vision_tower.", "vision_tower.")
        key = key.replace("model.multi_modal_projector.", "multi_modal_projector.")
        renamed[key] = value
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    again, _ = load(tmp_path)
    ids, pixels, grids = _inputs(model, tokenizer, files)
    expected = _reference(torch_model, ids, pixels, grids)
    assert np.abs(_ours(again, ids, pixels, grids) - expected).max() <= TOL


def test_convert_keeps_the_tower_float_and_the_processor(vlm, tmp_path):
    """After `convert` (float32) the same tokens; with -q the language model is quantized, the
    tower and projector stay float; processor_config.json comes along."""
    import mlx.nn as nn

    from mlxinfer.loading.convert import convert

    path, torch_model, model, tokenizer, files = vlm
    expected = _torch_greedy(torch_model, *_inputs(model, tokenizer, files[:1]), 4)
    convert(path, tmp_path / "f32", dtype="float32")
    again, tok = load(tmp_path / "f32")
    results = stream_generate(again, tok, TEXT, images=files[:1], chat_template=True, max_tokens=4)
    assert [r.token for r in results] == expected
    convert(path, tmp_path / "q4", quantize=True, bits=4, group_size=32)
    assert (tmp_path / "q4" / "processor_config.json").is_file()
    quant, tok = load(tmp_path / "q4")
    quantized = [p for p, m in quant.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert any(p.startswith("model.layers.") for p in quantized)
    assert not any(p.startswith(("vision_tower", "multi_modal_projector")) for p in quantized)
    results = stream_generate(quant, tok, TEXT, images=files[:1], chat_template=True, max_tokens=4)
    assert len(list(results)) == 4


def test_image_rows_in_the_batching_engine_equal_their_single_runs(vlm):
    """Two image rows (images of different sizes) and a text row at once, in chunks of 5 that
    cut the images (causal: no image blocks), give their stream_generate tokens."""
    from mlxinfer.batch import Engine

    _, _, model, tokenizer, files = vlm
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
