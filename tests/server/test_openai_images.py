"""OpenAI chat requests with images (``image_url`` data URLs), through the official ``openai``
client, to a tiny random Gemma 3 image-text checkpoint: the reply is the library's for the same
image, a second image changes it, and what the server cannot take is a 400 in OpenAI's shape."""

from __future__ import annotations

import base64
import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from gemma3_vlm import make_gemma3_vlm, random_image
from servers import serving

from mlxinfer.generation import generate
from mlxinfer.loading.loader import load
from mlxinfer.server import make_app

NAME = "tiny-gemma3-vlm"
app_of: dict = {}  # the served app, for its engine's counters
TEXT = "Describe this image."


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai_images")
    path, _, _ = make_gemma3_vlm(root / "model")
    files = []
    for i, size in enumerate([(150, 118), (131, 170)]):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    model, tokenizer = load(path)
    app = make_app(model, tokenizer, NAME)
    with serving(app) as base:
        app_of[NAME] = app
        yield (
            model,
            tokenizer,
            files,
            openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120),
        )


def _data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _messages(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u, "detail": "low"}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": TEXT}]}]


def _library(model, tokenizer, files) -> str:
    return generate(model, tokenizer, TEXT, images=files, chat_template=True, max_tokens=8)


def test_a_reply_with_an_image_is_the_library_s(vlm):
    model, tokenizer, files, client = vlm
    reply = client.chat.completions.create(
        model=NAME, messages=_messages(_data_url(files[0])), max_tokens=8, temperature=0
    )
    expected = _library(model, tokenizer, files[:1])
    assert expected and reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens == 8
    other = client.chat.completions.create(
        model=NAME, messages=_messages(_data_url(files[1])), max_tokens=8, temperature=0
    )
    assert other.choices[0].message.content == _library(model, tokenizer, files[1:])
    assert other.choices[0].message.content != expected


def test_a_streamed_reply_with_two_images(vlm):
    model, tokenizer, files, client = vlm
    chunks = client.chat.completions.create(
        model=NAME,
        messages=_messages(*(_data_url(f) for f in files)),
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _library(model, tokenizer, files)


def test_image_requests_and_a_text_request_run_together_in_the_engine(vlm):
    """Two image requests and a text request at once: each reply is its single run's, and the
    engine ran all three (the images batched beside the text, not one at a time outside)."""
    model, tokenizer, files, client = vlm
    engine = app_of[NAME].state.models.get(NAME).engine
    done = engine.requests_done
    asks = [_messages(_data_url(files[0])), _messages(*(_data_url(f) for f in files))]
    asks.append([{"role": "user", "content": TEXT}])

    def ask(messages):
        reply = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=8, temperature=0
        )
        return reply.choices[0].message.content

    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(ask, asks))
    text = generate(model, tokenizer, TEXT, chat_template=True, max_tokens=8)
    assert replies == [
        _library(model, tokenizer, files[:1]),
        _library(model, tokenizer, files),
        text,
    ]
    assert engine.requests_done == done + 3


def test_what_the_server_cannot_take_is_a_400(vlm, tmp_path):
    model, tokenizer, files, client = vlm
    with pytest.raises(openai.BadRequestError) as remote:
        client.chat.completions.create(
            model=NAME, messages=_messages("https://example.com/cat.png"), max_tokens=4
        )
    assert remote.value.code == "invalid_image_url" and "data URLs" in str(remote.value)
    with pytest.raises(openai.BadRequestError, match="image 1"):
        client.chat.completions.create(
            model=NAME, messages=_messages("data:image/png;base64,AAAA"), max_tokens=4
        )
    assert client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Still serving?"}], max_tokens=2
    ).choices


def test_a_text_only_model_refuses_image_parts(vlm, tmp_path):
    from safetensors.numpy import load_file, save_file

    model, tokenizer, files, _ = vlm
    text_only = tmp_path / "text-only"
    shutil.copytree(model.source_dir, text_only)
    weights = load_file(text_only / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if "vision" not in k and "projector" not in k},
        text_only / "model.safetensors",
        metadata={"format": "pt"},
    )
    text_model, text_tokenizer = load(text_only)
    with serving(make_app(text_model, text_tokenizer, "text")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="takes text only"):
            client.chat.completions.create(
                model="text", messages=_messages(_data_url(files[0])), max_tokens=4
            )
