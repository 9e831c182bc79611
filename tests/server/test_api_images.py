"""Images through the Anthropic, Responses and Ollama APIs and ``/v1/models``, each with its
official client, to a tiny random Gemma 3 image-text checkpoint (and a text-only copy served
beside it from a models directory): a reply with an image is the library's for the same image
(which a second image changes), and what the server cannot take is a 4xx in the API's shape."""

from __future__ import annotations

import base64

import anthropic
import httpx
import ollama
import openai
import pytest
from servers import serving
from vlm_serving import b64, data_url, hostile_images, text_only_copy, vlm_with_images

from mlxinfer.generation import generate
from mlxinfer.loading.loader import load
from mlxinfer.server import make_app

NAME, TEXT_ONLY = "tiny-gemma3-vlm", "text-only"
TEXT = "Describe this image."
GREEDY = {"temperature": 0}  # the anthropic client no longer takes it as an argument


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("api_images")
    path, files = vlm_with_images(root)
    text_only_copy(path, root / "models" / TEXT_ONLY)
    model, tokenizer = load(path)
    expected = [
        generate(model, tokenizer, TEXT, images=[f], chat_template=True, max_tokens=8)
        for f in files
    ]
    assert expected[0] != expected[1]  # else the tests below are blind
    app = make_app(model, tokenizer, NAME, models_dir=root / "models")
    with serving(app) as base:
        yield base, files, expected


# --- Anthropic Messages ---------------------------------------------------------------------


def _image_block(path) -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(path)},
    }


def _anthropic(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120)


def test_anthropic_image_blocks(served):
    base, files, expected = served
    client = _anthropic(base)
    for f, want in zip(files, expected):
        reply = client.messages.create(
            model=NAME,
            max_tokens=8,
            extra_body=GREEDY,
            messages=[
                {"role": "user", "content": [_image_block(f), {"type": "text", "text": TEXT}]}
            ],
        )
        assert reply.content[0].text == want
    with client.messages.stream(
        model=NAME,
        max_tokens=8,
        extra_body=GREEDY,
        messages=[
            {"role": "user", "content": [_image_block(files[1]), {"type": "text", "text": TEXT}]}
        ],
    ) as stream:
        assert "".join(stream.text_stream) == expected[1]
    counted = client.messages.count_tokens(
        model=NAME,
        messages=[
            {"role": "user", "content": [_image_block(files[0]), {"type": "text", "text": TEXT}]}
        ],
    )
    plain = client.messages.count_tokens(model=NAME, messages=[{"role": "user", "content": TEXT}])
    assert counted.input_tokens > plain.input_tokens + 4  # the image's soft tokens counted


def test_anthropic_refusals_are_its_errors(served):
    base, files, _ = served
    client = _anthropic(base)
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    remote = "image 1: remote image URLs are refused.*serve --allow-remote-images"
    for block, words in ((url, remote), (bad, "image 1")):
        with pytest.raises(anthropic.BadRequestError, match=words) as e:
            client.messages.create(
                model=NAME, max_tokens=4, messages=[{"role": "user", "content": [block]}]
            )
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match=f"model '{TEXT_ONLY}' takes text only"):
        client.messages.create(
            model=TEXT_ONLY,
            max_tokens=4,
            messages=[{"role": "user", "content": [_image_block(files[0])]}],
        )


def test_anthropic_tool_result_images(served):
    """A tool result's image reaches a model that reads images, and is a one-line note for a
    text-only model (so that an agent's session goes on)."""
    base, files, _ = served
    client = _anthropic(base)

    def reply(model: str, result) -> str:
        messages = [
            {"role": "user", "content": "Look at the picture."},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": result},
                    {"type": "text", "text": TEXT},
                ],
            },
        ]
        out = client.messages.create(
            model=model, max_tokens=8, extra_body=GREEDY, messages=messages
        )
        return out.content[0].text

    assert reply(NAME, [_image_block(files[0])]) != reply(NAME, [_image_block(files[1])])
    note = f"[image omitted: model '{TEXT_ONLY}' takes text only]"
    assert reply(TEXT_ONLY, [_image_block(files[0])]) == reply(TEXT_ONLY, note)


# --- Responses API --------------------------------------------------------------------------


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def _input(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "input_text", "text": TEXT}]}]


def _input_image(path) -> dict:
    return {"type": "input_image", "image_url": data_url(path), "detail": "auto"}


def test_responses_input_image(served):
    base, files, expected = served
    client = _openai(base)
    for f, want in zip(files, expected):
        reply = client.responses.create(
            model=NAME, input=_input(_input_image(f)), max_output_tokens=8, temperature=0
        )
        assert reply.output_text == want
    events = client.responses.create(
        model=NAME,
        input=_input(_input_image(files[0])),
        max_output_tokens=8,
        temperature=0,
        stream=True,
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected[0]


def test_responses_refusals(served):
    base, files, _ = served
    client = _openai(base)
    cases = [
        ({"type": "input_image", "file_id": "file-1"}, "keeps no files"),
        ({"type": "input_image", "image_url": "https://example.com/a.png"}, "data URLs"),
        ({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}, "image 1"),
    ]
    for part, words in cases:
        with pytest.raises(openai.BadRequestError, match=words):
            client.responses.create(model=NAME, input=_input(part), max_output_tokens=4)
    with pytest.raises(openai.BadRequestError, match=f"model '{TEXT_ONLY}' takes text only"):
        client.responses.create(
            model=TEXT_ONLY, input=_input(_input_image(files[0])), max_output_tokens=4
        )
    # Codex's view_image: a tool output's image, a note for a text-only model
    history = [
        {"role": "user", "content": "Look"},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [_input_image(files[0])]},
    ]
    assert client.responses.create(model=TEXT_ONLY, input=history, max_output_tokens=2).output
    assert client.responses.create(model=NAME, input=history, max_output_tokens=2).output


# --- Ollama ---------------------------------------------------------------------------------


def test_ollama_images(served):
    base, files, expected = served
    client = ollama.Client(host=base, timeout=120)
    greedy = {"temperature": 0, "num_predict": 8}
    for f, want in zip(files, expected):
        message = {"role": "user", "content": TEXT, "images": [f]}  # the client sends base64
        reply = client.chat(model=NAME, messages=[message], options=greedy)
        assert reply.message.content == want
    streamed = client.generate(
        model=NAME, prompt=TEXT, images=[files[1].read_bytes()], options=greedy, stream=True
    )
    assert "".join(c.response for c in streamed) == expected[1]
    assert "vision" in client.show(NAME).capabilities
    assert "vision" not in client.show(TEXT_ONLY).capabilities


def test_ollama_refusals(served):
    base, files, _ = served
    client = ollama.Client(host=base, timeout=60)
    with pytest.raises(ollama.ResponseError, match="images") as e:
        client.generate(model=NAME, prompt="x", images=[files[0]], raw=True)
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="image 1") as e:
        client.chat(model=NAME, messages=[{"role": "user", "content": "x", "images": ["AAAA"]}])
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match=f"model '{TEXT_ONLY}' takes text only"):
        client.generate(model=TEXT_ONLY, prompt="x", images=[files[0]])
    # a tool turn's image is a note for a text-only model, as in the other APIs
    tool = [
        {"role": "user", "content": "Look"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "view", "arguments": {}}}]},
        {"role": "tool", "tool_name": "view", "content": "", "images": [files[0]]},
    ]
    assert client.chat(model=TEXT_ONLY, messages=tool, options={"num_predict": 2}).done
    # a path is never read from the server's disk: only image data is taken
    r = httpx.post(
        f"{base}/api/generate",
        json={"model": NAME, "prompt": "x", "images": [str(files[0])], "stream": False},
        timeout=60,
    )
    assert r.status_code == 400 and "image 1" in r.json()["error"]


def test_the_model_list_says_which_models_read_images(served):
    base, _, _ = served
    models = {m.id: m for m in _openai(base).models.list()}
    assert models[NAME].input_modalities == ["text", "image"]
    assert models[TEXT_ONLY].input_modalities == ["text"]


# --- hostile images, every API ---------------------------------------------------------------


def test_hostile_images_are_a_400_in_each_api_s_shape(served):
    """A bomb, a truncated file, a format outside the allow-list, no bytes at all: each API's
    400 in its own shape naming the image, and the server still serves."""
    base, files, expected = served

    def bodies(data: str) -> dict:
        url = f"data:image/png;base64,{data}"
        source = {"type": "base64", "media_type": "image/png", "data": data}
        return {
            "/v1/chat/completions": {
                "model": NAME,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
                ],
            },
            "/v1/messages": {
                "model": NAME,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}],
            },
            "/v1/responses": {
                "model": NAME,
                "input": _input({"type": "input_image", "image_url": url}),
            },
            "/api/chat": {
                "model": NAME,
                "stream": False,
                "messages": [{"role": "user", "content": "x", "images": [data or "="]}],
            },
        }

    for kind, raw in hostile_images(files[0]).items():
        data = base64.b64encode(raw).decode()
        for route, body in bodies(data).items():
            r = httpx.post(base + route, json=body, timeout=60)
            assert r.status_code == 400, (kind, route, r.text)
            error = r.json()["error"]
            message = error if isinstance(error, str) else error["message"]
            assert "image 1" in message and "\n" not in message, (kind, route, message)
            if route == "/v1/messages":
                assert r.json()["type"] == "error"
    reply = _openai(base).responses.create(
        model=NAME, input=_input(_input_image(files[0])), max_output_tokens=8, temperature=0
    )
    assert reply.output_text == expected[0]


@pytest.mark.parametrize(
    ("model_type", "tensor", "takes"),
    [
        ("idefics3", "model.vision_model.embeddings.patch_embedding.weight", True),  # SmolVLM
        ("llava", "model.vision_tower.vision_model.post_layernorm.weight", True),
        ("qwen2_5_vl", "model.visual.merger.mlp.0.weight", True),
        ("idefics3", "model.text_model.norm.weight", False),  # the tower stripped: text only
        ("llama", "model.vision_model.x.weight", False),  # a family without a tower here
    ],
)
def test_a_model_not_loaded_yet_is_judged_by_its_config_and_tower_weights(
    tmp_path, model_type, tensor, takes
):
    import json

    import mlx.core as mx

    from mlxinfer.server.image_parts import config_takes_images

    config = {"model_type": model_type, "vision_config": {"hidden_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {tensor: mx.zeros((2,))})
    assert config_takes_images(tmp_path) is takes
