"""Images through generation: ``stream_generate(images=...)`` and ``mlxinfer generate --image``
on a tiny random Gemma 3 image-text checkpoint, against transformers' greedy tokens for the
same rendered prompt and images (its own processor), and never a cache reused across images."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from gemma3_vlm import random_image
from PIL import Image
from test_gemma3_vlm import _torch_greedy

from mlxinfer.cache.prompt import PromptCache
from mlxinfer.cli.main import cli
from mlxinfer.errors import MediaError
from mlxinfer.generation import generate, prepare_prompt, stream_generate
from mlxinfer.generation.images import load_images
from mlxinfer.loading.loader import load

TEXT = "Describe this image."


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from gemma3_vlm import make_gemma3_vlm

    root = tmp_path_factory.mktemp("gemma3_generate")
    path, torch_model, processor = make_gemma3_vlm(root / "model")
    files = []
    for i, size in enumerate([(150, 118), (131, 170)]):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    model, tokenizer = load(path)
    return path, torch_model, processor, model, tokenizer, files


def _reference(torch_model, processor, files, steps=8):
    content = [{"type": "image"}] * len(files) + [{"type": "text", "text": TEXT}]
    rendered = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    pictures = [Image.open(f).convert("RGB") for f in files]
    batch = processor(text=rendered, images=pictures, return_tensors="pt")
    return batch["input_ids"][0].tolist(), _torch_greedy(torch_model, batch, steps)


def _tokens(model, tokenizer, files, **options):
    results = stream_generate(
        model, tokenizer, TEXT, images=files, chat_template=True, max_tokens=8, **options
    )
    return [r.token for r in results]


@pytest.mark.parametrize("n_images", [1, 2])
def test_generate_with_images_gives_transformers_tokens(vlm, n_images):
    _, torch_model, processor, model, tokenizer, files = vlm
    ids, expected = _reference(torch_model, processor, files[:n_images])
    images = load_images(model, tokenizer, files[:n_images])
    assert prepare_prompt(tokenizer, TEXT, images=images) == ids
    assert _tokens(model, tokenizer, files[:n_images]) == expected


def test_an_image_is_never_split_across_prefill_chunks(vlm):
    _, torch_model, processor, model, tokenizer, files = vlm
    _, expected = _reference(torch_model, processor, files)
    # Chunks of 3 tokens would cut each 4-token image; each chunk is stretched to its end.
    assert _tokens(model, tokenizer, files, prefill_step_size=3) == expected


def test_a_prompt_cache_is_never_reused_across_images(vlm):
    """Every image's placeholder ids are the same: a cache keyed by ids would hand the second
    image the first one's keys. A request with images runs on a fresh cache of its own."""
    _, _, _, model, tokenizer, files = vlm
    pc = PromptCache(model.make_cache())

    def first_logprobs(image, **options):
        results = stream_generate(
            model, tokenizer, TEXT, images=[image], chat_template=True, max_tokens=1, **options
        )
        return np.array(next(iter(results)).logprobs)

    a = first_logprobs(files[0], prompt_cache=pc)
    b = first_logprobs(files[1], prompt_cache=pc)
    fresh_b = first_logprobs(files[1])
    assert np.abs(b - fresh_b).max() <= 1e-5
    assert np.abs(a - b).max() > 0.1
    assert pc.tokens == []  # the caller's cache holds no image prompt


def test_a_model_without_a_tower_refuses_images_in_one_line(vlm, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, _, _, _, _, files = vlm
    text_only = tmp_path / "text-only"
    shutil.copytree(path, text_only)
    weights = load_file(text_only / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if "vision" not in k and "projector" not in k},
        text_only / "model.safetensors",
        metadata={"format": "pt"},
    )
    model, tokenizer = load(text_only)
    with pytest.raises(MediaError, match=r"^text-only: a model without a vision tower"):
        generate(model, tokenizer, TEXT, images=files[:1], chat_template=True, max_tokens=2)


def test_images_need_the_chat_template(vlm):
    _, _, _, model, tokenizer, files = vlm
    with pytest.raises(MediaError, match="chat template's image markers"):
        generate(model, tokenizer, TEXT, images=files[:1], max_tokens=2)
    with pytest.raises(MediaError, match="not token ids"):
        generate(model, tokenizer, [1, 2, 3], images=files[:1], max_tokens=2)


def test_cli_generate_image_prints_the_library_s_text(vlm):
    path, _, _, model, tokenizer, files = vlm
    args = ["generate", "-m", str(path), "-p", TEXT, "-n", "8"]
    run = CliRunner().invoke(cli, [*args, "--image", str(files[0]), "--image", str(files[1])])
    assert run.exit_code == 0, run.output
    expected = generate(model, tokenizer, TEXT, images=files, chat_template=True, max_tokens=8)
    assert expected.strip() and run.stdout.rstrip("\n") == expected.rstrip("\n")
    refused = CliRunner().invoke(cli, [*args, "--image", str(files[0]), "--no-chat-template"])
    assert (
        refused.exit_code == 2 and "--image does not go with --no-chat-template" in refused.output
    )


def test_convert_keeps_the_tower_float_and_the_processor(vlm, tmp_path):
    """After `convert` (float32) the same tokens; with -q the language model is quantized and
    the tower and projector stay float; processor_config.json comes along."""
    import mlx.nn as nn

    from mlxinfer.loading.convert import convert

    path, torch_model, processor, _, _, files = vlm
    _, expected = _reference(torch_model, processor, files[:1])
    convert(path, tmp_path / "f32", dtype="float32")
    model, tokenizer = load(tmp_path / "f32")
    assert _tokens(model, tokenizer, files[:1]) == expected
    convert(path, tmp_path / "q4", quantize=True, bits=4, group_size=32)
    assert (tmp_path / "q4" / "processor_config.json").is_file()
    model, tokenizer = load(tmp_path / "q4")
    quantized = [p for p, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert any(p.startswith("model.layers.") for p in quantized)
    assert not any(p.startswith(("vision_tower", "multi_modal_projector")) for p in quantized)
    assert len(_tokens(model, tokenizer, files[:1])) == 8


def test_a_chat_keeps_its_images_across_turns(vlm):
    """The second turn's prompt holds the first turn's image (sent again, on a fresh cache): the
    same tokens as transformers for the whole history with that image. A turn refused before any
    reply (an image that does not decode) is undone."""
    from mlxinfer.generation.chat import ChatSession

    _, torch_model, processor, model, tokenizer, files = vlm
    chat = ChatSession(model, tokenizer, max_tokens=8)
    first = [r.token for r in chat.send(TEXT, [files[0]])]
    assert first == _reference(torch_model, processor, files[:1])[1]
    with pytest.raises(MediaError):
        list(chat.send("And this one?", [files[0].parent / "missing.png"]))
    assert len(chat.messages) == 2 and chat.images == [files[0]]
    second = [r.token for r in chat.send("What color is it?")]
    history = processor.tokenizer.apply_chat_template(
        chat.messages[:-1], add_generation_prompt=True, tokenize=False
    )
    batch = processor(
        text=history, images=[Image.open(files[0]).convert("RGB")], return_tensors="pt"
    )
    assert second == _torch_greedy(torch_model, batch, 8)


def test_cli_chat_image_command(vlm):
    path, _, _, model, tokenizer, files = vlm
    typed = f"/image {files[1]}\n{TEXT}\n/exit\n"
    run = CliRunner().invoke(cli, ["chat", "-m", str(path), "-n", "8"], input=typed)
    assert run.exit_code == 0, run.output
    expected = generate(model, tokenizer, TEXT, images=files[1:], chat_template=True, max_tokens=8)
    assert expected.strip() and expected.strip() in run.stdout
