"""Qwen3.5 with images against transformers: a tiny random checkpoint.

``Qwen3_5ForConditionalGeneration`` (float32, saved by transformers 5,
tests/support/qwen3_5_vl.py): Qwen3-VL's tower without deepstack over the hybrid trunk (Gated
DeltaNet layers, gated full attention with interleaved multimodal RoPE over half the head).
The images go through mlxinfer's processor (test_processors.py proves its pixels and ids equal
to transformers'; the Qwen Processor class cannot be built here: its video processor needs
torchvision), and the same pixel values, ``image_grid_thw`` and ``mm_token_type_ids`` are fed
to transformers.

Our tower's features within 1e-4 of ``get_image_features``; logits within 1e-3 at every
position with one and two images, with and without the cache, and on text alone; greedy tokens
identical for 8 steps through prefill chunks that cut an image (the DeltaNet state carried
from chunk to chunk) and the cache; ``mlxinfer.generate(..., images=[...])`` gives
transformers' tokens; ``convert -q`` keeps the tower float; without the tower's weights the
checkpoint runs as Qwen3.5's text model.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from gemma3_vlm import random_image
from qwen3_5_vl import make_qwen3_5_vl

from mlxinfer.generation import generate, prepare_prompt, stream_generate
from mlxinfer.generation.images import load_images
from mlxinfer.loading.loader import load
from mlxinfer.vision import load_image, load_processor

TOL = 1e-3
TEXT = "Describe this image."
SIZES = [(150, 118), (131, 170)]  # (width, height): non-square, larger than the grids' unit


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    path, torch_model = make_qwen3_5_vl(root / "model")
    files = []
    for i, size in enumerate(SIZES):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    model, tokenizer = load(path)
    processor = load_processor(path, tokenizer=tokenizer)
    return path, torch_model, model, tokenizer, processor, files


def _batch(vlm, n_images: int, text: str = TEXT) -> dict:
    """A prompt whose user turn holds the images, each followed by text: our ids and pixels."""
    _, _, _, tokenizer, processor, files = vlm
    content = []
    for i in range(n_images):
        content += [{"type": "image"}, {"type": "text", "text": f"{text} {i}"}]
    content = content or [{"type": "text", "text": text}]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    images = [load_image(f.read_bytes()) for f in files[:n_images]]
    processed = processor.prepare(images)
    ids = tokenizer.encode(processor.expand(rendered, processed) if images else rendered)
    return {"ids": ids, "processed": processed if images else None}


def _torch_inputs(torch_model, batch) -> dict:
    ids = torch.tensor([batch["ids"]])
    out = {"input_ids": ids}
    if batch["processed"] is not None:
        out["pixel_values"] = torch.tensor(batch["processed"].pixel_values)
        out["image_grid_thw"] = torch.tensor(batch["processed"].grid_thw)
        out["mm_token_type_ids"] = (ids == torch_model.config.image_token_id).int()
    return out


def _reference(torch_model, batch) -> np.ndarray:
    with torch.no_grad():
        return torch_model(**_torch_inputs(torch_model, batch)).logits[0].numpy()


def _extra(model, batch) -> dict:
    processed = batch["processed"]
    if processed is None:
        return {}
    features = model.encode_images(mx.array(processed.pixel_values), processed.grid_thw)
    return model.image_inputs(batch["ids"], features)


def _ours(model, batch, cache=None, **drop) -> np.ndarray:
    extra = {k: v for k, v in _extra(model, batch).items() if k not in drop}
    return np.array(model(mx.array([batch["ids"]]), cache, **extra)[0])


def test_the_model_loads_with_its_tower(vlm):
    _, _, model, _, _, _ = vlm
    assert type(model).__module__ == "mlxinfer.models.qwen3_5_vl"
    assert model.visual.patch_embed.proj.weight.shape[0] == 32
    assert model.args.vision.deepstack_visual_indexes == []


def test_image_features_match_transformers(vlm):
    """Two images of different sizes in one call (block-diagonal attention); no deepstack."""
    _, torch_model, model, _, _, _ = vlm
    processed = _batch(vlm, 2)["processed"]
    assert processed.grid_thw[0].tolist() != processed.grid_thw[1].tolist()
    with torch.no_grad():
        theirs = torch_model.model.get_image_features(
            torch.tensor(processed.pixel_values), torch.tensor(processed.grid_thw)
        )
    ours = model.encode_images(mx.array(processed.pixel_values), processed.grid_thw)
    expected = torch.cat(theirs.pooler_output).numpy()
    assert ours["tokens"].shape == expected.shape
    assert np.abs(np.array(ours["tokens"]) - expected).max() <= 1e-4
    assert ours["deepstack"] == []


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_match_at_every_position(vlm, n_images):
    _, torch_model, model, _, _, _ = vlm
    batch = _batch(vlm, n_images)
    expected = _reference(torch_model, batch)
    assert np.abs(_ours(model, batch) - expected).max() <= TOL
    assert np.abs(_ours(model, batch, model.make_cache()) - expected).max() <= TOL
    # Not blind: with text positions for the images (no M-RoPE) the logits move.
    assert np.abs(_ours(model, batch, positions=True) - expected).max() > 10 * TOL


def test_a_text_only_prompt_on_the_same_checkpoint_matches(vlm):
    _, torch_model, model, _, _, _ = vlm
    batch = _batch(vlm, 0, "What is a cat?")
    assert np.abs(_ours(model, batch) - _reference(torch_model, batch)).max() <= TOL


_GREEDY: dict[tuple[int, ...], list[int]] = {}


def _torch_greedy(torch_model, batch, steps: int = 8) -> list[int]:
    """transformers' greedy ``generate`` (its own cache and rope deltas), kept per prompt (its
    DeltaNet's reference path is slow)."""
    key = tuple(batch["ids"])
    if key not in _GREEDY:
        _GREEDY[key] = _torch_greedy_run(torch_model, batch, steps)
    return _GREEDY[key]


def _torch_greedy_run(torch_model, batch, steps: int) -> list[int]:
    inputs = _torch_inputs(torch_model, batch)
    with torch.no_grad():
        out = torch_model.generate(
            **inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False
        )
    return out[0, len(batch["ids"]) :].tolist()


def test_greedy_through_chunks_that_cut_an_image_and_the_cache(vlm):
    """Prefill in 7-token chunks (each its own slice of positions; the DeltaNet layers' state
    and conv inputs carried from chunk to chunk, an image cut between them), then decode at
    offset + delta from the cache."""
    _, torch_model, model, _, _, _ = vlm
    batch = _library_batch(vlm)
    ids, extra = batch["ids"], _extra(model, batch)
    cache = model.make_cache()
    for start in range(0, len(ids), 7):
        chunk = {k: v[..., start : start + 7, :] for k, v in extra.items()}
        logits = model(mx.array([ids[start : start + 7]]), cache, **chunk)
    out = []
    for _ in range(8):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache)
    assert out == _torch_greedy(torch_model, batch)


def _library_batch(vlm) -> dict:
    """The two images' prompt as the library builds it (images before the text)."""
    _, _, model, tokenizer, _, files = vlm
    images = load_images(model, tokenizer, files)
    return {"ids": prepare_prompt(tokenizer, TEXT, images=images), "processed": images.processed}


def _files_tokens(model, tokenizer, files, prompt: str = TEXT, **options) -> list[int]:
    results = stream_generate(
        model, tokenizer, prompt, images=files, chat_template=True, max_tokens=8, **options
    )
    return [r.token for r in results]


def test_generate_with_images_gives_transformers_tokens(vlm):
    """The library end to end (template, markers, processor, tower, chunked prefill, decode),
    two images, prefill chunks of 5 tokens; one image or the other gives other tokens."""
    _, torch_model, model, tokenizer, _, files = vlm
    expected = _torch_greedy(torch_model, _library_batch(vlm))
    assert _files_tokens(model, tokenizer, files, prefill_step_size=5) == expected
    assert _files_tokens(model, tokenizer, files[:1]) != _files_tokens(model, tokenizer, files[1:])
    text = generate(model, tokenizer, TEXT, images=files, chat_template=True, max_tokens=8)
    assert text == tokenizer.decode(expected)


def test_convert_keeps_the_tower_float(vlm, tmp_path):
    import mlx.nn as nn

    from mlxinfer.loading.convert import convert

    path, _, _, _, _, files = vlm
    convert(path, tmp_path / "q4", quantize=True, bits=4, group_size=32)
    assert (tmp_path / "q4" / "processor_config.json").is_file()
    quantized_model, tokenizer = load(tmp_path / "q4")
    quantized = [p for p, m in quantized_model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert any(p.startswith("model.layers.") for p in quantized)
    assert not any(p.startswith("visual") for p in quantized)
    assert len(_files_tokens(quantized_model, tokenizer, files[:1])) == 8


def test_without_the_tower_s_weights_the_language_model_runs_alone(vlm, tmp_path):
    """The language model is qwen3_5_text's (on text M-RoPE is RoPE): the same logits on
    text; images are refused in one line."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from mlxinfer.errors import MediaError

    path, torch_model, _, _, _, files = vlm
    text_only = tmp_path / "text-only"
    shutil.copytree(path, text_only)
    weights = load_file(text_only / "model.safetensors")
    kept = {k: v for k, v in weights.items() if "visual" not in k}
    save_file(kept, text_only / "model.safetensors", metadata={"format": "pt"})
    model, tokenizer = load(text_only)
    assert type(model).__module__ == "mlxinfer.models.qwen3_5"
    batch = _batch(vlm, 0, "What is a cat?")
    assert np.abs(_ours(model, batch) - _reference(torch_model, batch)).max() <= TOL
    with pytest.raises(MediaError, match=r"^text-only: a model without a vision tower"):
        generate(model, tokenizer, TEXT, images=files[:1], chat_template=True, max_tokens=2)


def test_image_rows_in_the_batching_engine_equal_their_single_runs(vlm):
    """Two image rows (one with two images) and a text row in one batch (4-token blocks,
    5-token chunks: images cut between chunks, the rows' DeltaNet states kept per row), each
    decoding at its own M-RoPE positions; then each image request again with its full blocks
    shared (resumed from a state snapshot, its delta still its own): the single-run tokens."""
    from mlxinfer.batch import Engine

    _, _, model, tokenizer, _, files = vlm
    asks = [(TEXT, files[:1]), (TEXT, files[1:]), ("What color is it?", None)]
    expected = [_files_tokens(model, tokenizer, i, prompt=p) for p, i in asks]
    assert expected[0] != expected[1]
    with Engine(model, block_size=4, prefill_step=5) as engine:
        assert engine.image_refusal() is None
        streams = [
            engine.start(tokenizer, p, images=i, chat_template=True, max_tokens=8) for p, i in asks
        ]
        assert [[r.token for r in s] for s in streams] == expected
        for (prompt, images), want in zip(asks[:2], expected):
            stream = engine.start(
                tokenizer, prompt, images=images, chat_template=True, max_tokens=8
            )
            assert [r.token for r in stream] == want
            assert stream.handle.cached_tokens > 0


def test_the_experts_model_with_images_matches_transformers(vlm, tmp_path):
    """Qwen3_5MoeForConditionalGeneration (model_type qwen3_5_moe): the same tower and trunk
    with experts; logits within 1e-3 at every position with one image and on text."""
    _, _, _, _, _, files = vlm
    path, torch_model = make_qwen3_5_vl(tmp_path / "moe", moe=True)
    model, tokenizer = load(path)
    assert type(model).__module__ == "mlxinfer.models.qwen3_5_vl" and model.args.num_experts == 4
    moe = (path, torch_model, model, tokenizer, load_processor(path, tokenizer=tokenizer), files)
    for n_images in (0, 1):
        batch = _batch(moe, n_images)
        assert np.abs(_ours(model, batch) - _reference(torch_model, batch)).max() <= TOL
