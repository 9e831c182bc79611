"""Images from the library's and the CLI's other entry points, on a tiny random Gemma 3
image-text checkpoint: ``generate --batch FILE --image PATH`` (every prompt's image; each line
equal to its single ``generate --image`` run), and chat messages carrying their images as
content parts (``{"type": "image", "image": path | bytes | PIL image}``, OpenAI's ``image_url``)
through ``generate``, ``batch_generate`` and ``ChatSession``: the same text as ``images=``."""

from __future__ import annotations

import base64
import json

import pytest
from click.testing import CliRunner
from gemma3_vlm import make_gemma3_vlm, random_image
from PIL import Image

from mlxinfer.batch import batch_generate
from mlxinfer.cli.main import cli
from mlxinfer.errors import MediaError
from mlxinfer.generation import generate
from mlxinfer.generation.chat import ChatSession
from mlxinfer.loading.loader import load

TEXT = "Describe this image."
PROMPTS = [TEXT, "What color is it?"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("image_entry_points")
    path, _, _ = make_gemma3_vlm(root / "model")
    files = []
    for i, size in enumerate([(150, 118), (131, 170)]):
        files.append(root / f"image{i}.png")
        random_image(i + 1, size).save(files[-1])
    model, tokenizer = load(path)
    return path, model, tokenizer, files


def _with(model, tokenizer, prompt, files) -> str:
    return generate(model, tokenizer, prompt, images=files, chat_template=True, max_tokens=8)


def test_batch_with_an_image_gives_each_prompt_its_single_run(vlm, tmp_path):
    path, model, tokenizer, files = vlm
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    base = ["generate", "-m", str(path), "-n", "8", "--image", str(files[0])]
    run = CliRunner().invoke(cli, [*base, "--batch", str(prompts)])
    assert run.exit_code == 0, run.output
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    singles = []
    for p in PROMPTS:
        single = CliRunner().invoke(cli, [*base, "-p", p])
        assert single.exit_code == 0, single.output
        singles.append(single.stdout.rstrip("\n"))
    assert [line["text"] for line in lines] == singles
    assert singles == [_with(model, tokenizer, p, files[:1]) for p in PROMPTS]
    assert singles[0] != _with(model, tokenizer, PROMPTS[0], files[1:])  # the image matters
    refused = CliRunner().invoke(cli, [*base, "--batch", str(prompts), "--no-chat-template"])
    assert (
        refused.exit_code == 2 and "--image does not go with --no-chat-template" in refused.output
    )


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def _text(t: str = TEXT) -> dict:
    return {"type": "text", "text": t}


def test_messages_carry_their_images_as_content_parts(vlm):
    _, model, tokenizer, files = vlm
    one = _with(model, tokenizer, TEXT, files[:1])
    two = _with(model, tokenizer, TEXT, files)
    assert one != two
    url = "data:image/png;base64," + base64.b64encode(files[0].read_bytes()).decode()
    sources = [str(files[0]), files[0], files[0].read_bytes(), Image.open(files[0]), url]
    for source in sources[:-1]:
        messages = _user({"type": "image", "image": source}, _text())
        assert generate(model, tokenizer, messages, max_tokens=8) == one, type(source)
    for image_url in ({"url": url, "detail": "low"}, url):  # OpenAI's part, and its short form
        messages = _user({"type": "image_url", "image_url": image_url}, _text())
        assert generate(model, tokenizer, messages, max_tokens=8) == one
    both = _user(
        {"type": "image", "image": files[0]}, {"type": "image", "image": files[1]}, _text()
    )
    assert generate(model, tokenizer, both, max_tokens=8) == two
    # the batching engine takes them too, beside a prompt with no image
    texts = batch_generate(model, tokenizer, [both, _user(_text())], max_tokens=8)
    assert texts == [two, generate(model, tokenizer, _user(_text()), max_tokens=8)]
    with pytest.raises(MediaError, match="image 1"):
        generate(model, tokenizer, _user({"type": "image", "image": b"not an image"}, _text()))


def test_a_chat_turn_of_content_parts(vlm):
    _, model, tokenizer, files = vlm
    by_images = ChatSession(model, tokenizer, max_tokens=8)
    by_parts = ChatSession(model, tokenizer, max_tokens=8)
    want = "".join(r.text for r in by_images.send(TEXT, [files[0]]))
    got = "".join(r.text for r in by_parts.send([{"type": "image", "image": files[0]}, _text()]))
    assert got == want == _with(model, tokenizer, TEXT, files[:1])
    follow = "What else?"
    assert "".join(r.text for r in by_parts.send(follow)) == "".join(
        r.text for r in by_images.send(follow)
    )
