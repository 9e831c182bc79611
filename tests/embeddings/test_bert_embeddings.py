"""Sentence embeddings from a BERT (mlxinfer/embeddings/, the ``bert`` family): a tiny random
BERT (tests/models/test_bert.py's ``write_bert``) with sentence-transformers' files. The
reference is transformers' ``BertModel`` on a padded batch with its attention mask, pooled by
sentence-transformers' formula (``Pooling``: the mask-weighted mean, or the first token's
state; then ``Normalize``), the texts cut by transformers' tokenizer at ``max_seq_length``.
Also: ``convert`` and ``-q`` keep an embedding checkpoint embedding, ``mlxinfer embed``, and
``/v1/embeddings`` serving it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_bert import write_bert

from mlxinfer import embed, load
from mlxinfer.embeddings import Pooling, read_pooling
from mlxinfer.errors import ConfigError, PromptTooLongError

MAX_SEQ_LENGTH = 24  # below the tiny model's 64 positions: long texts are cut
TEXTS = [
    "Hello world",
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog. " * 3,
    "a",
    "naïve café 東京 🙂 def f(x): return x * 2",
    "",
]
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    # all-MiniLM-L6-v2 names a 2_Normalize folder its repository does not have; nor does this.
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]


def write_sentence_transformers(path: Path, mode: str = "mean_tokens", **sentence_bert) -> Path:
    """all-MiniLM-L6-v2's files: modules.json, 1_Pooling/config.json, sentence_bert_config.json."""
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
    pooling = {"word_embedding_dimension": 64, **{f"pooling_mode_{m}": m == mode for m in modes}}
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "modules.json").write_text(json.dumps(MODULES))
    settings = {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False, **sentence_bert}
    (path / "sentence_bert_config.json").write_text(json.dumps(settings))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, tokenizer, model = write_bert(tmp_path_factory.mktemp("st") / "tiny-minilm")
    return write_sentence_transformers(path), tokenizer, model


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load(str(checkpoint[0]))


def reference(checkpoint, texts, mode="mean", max_length=MAX_SEQ_LENGTH, lower=False):
    """sentence-transformers' vectors, by its own formula on transformers' padded batch."""
    _, tokenizer, model = checkpoint
    texts = [t.lower() for t in texts] if lower else texts
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length)
    batch = {k: torch.tensor(v) for k, v in batch.items()}
    with torch.no_grad():
        states = model(**batch).last_hidden_state  # (B, L, hidden)
    if mode == "cls":
        pooled = states[:, 0]
    else:  # Pooling's mean: sum(states * mask) / clamp(sum(mask), 1e-9)
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()


def test_the_checkpoint_says_mean_normalised_and_its_max_seq_length(checkpoint):
    assert not (checkpoint[0] / "2_Normalize").exists()
    assert read_pooling(checkpoint[0]) == Pooling("mean", True, 64, MAX_SEQ_LENGTH, False)


def test_embed_matches_sentence_transformers_formula(checkpoint, loaded):
    """One padded batch of mixed lengths (one cut at max_seq_length, one empty text that is
    [CLS] [SEP]) gives the reference's vectors; each text alone gives the same."""
    model, tokenizer = loaded
    long_ids = checkpoint[1](TEXTS[1])["input_ids"]
    assert len(long_ids) > MAX_SEQ_LENGTH  # the cut is exercised
    vectors = np.array(embed(model, tokenizer, TEXTS))
    expected = reference(checkpoint, TEXTS)
    assert vectors.shape == (len(TEXTS), 64) and vectors.dtype == np.float32
    np.testing.assert_allclose(vectors, expected, atol=1e-4)
    assert ((vectors * expected).sum(1) >= 0.9999).all()
    for i, text in enumerate(TEXTS):
        np.testing.assert_allclose(
            np.array(embed(model, tokenizer, text))[0], vectors[i], atol=1e-5
        )
    # Several batches (a budget of 30 padded tokens) are the same vectors too.
    from mlxinfer.embeddings import embed_ids, encode_inputs

    pooling = read_pooling(checkpoint[0])
    rows = encode_inputs(model, tokenizer, TEXTS, pooling=pooling)
    assert [len(r) for r in rows] == [
        len(r)
        for r in checkpoint[1](TEXTS, truncation=True, max_length=MAX_SEQ_LENGTH)["input_ids"]
    ]
    np.testing.assert_allclose(
        np.array(embed_ids(model, rows, pooling, batch_tokens=30)), vectors, atol=1e-5
    )


def test_cls_pooling_lower_casing_and_no_cut(checkpoint, tmp_path):
    """``pooling_mode_cls_token``; ``do_lower_case``: the text lower-cased before the tokenizer
    sees it (this tokenizer lower-cases too, so a recording one shows it); no
    sentence_bert_config.json: nothing cut, a text past the context is refused."""
    path = tmp_path / "cls"
    shutil.copytree(checkpoint[0], path)
    write_sentence_transformers(path, "cls_token", do_lower_case=True)
    model, tokenizer = load(str(path))
    vectors = np.array(embed(model, tokenizer, TEXTS))
    np.testing.assert_allclose(vectors, reference(checkpoint, TEXTS, "cls", lower=True), atol=1e-4)
    from mlxinfer.embeddings import encode_inputs

    class Recording:
        seen: list[str] = []

        def encode(self, text, add_special_tokens=True):
            self.seen.append(text)
            return [2, 3]

    encode_inputs(model, Recording(), ["HeLLo Ünï"], pooling=read_pooling(path))
    encode_inputs(model, Recording(), ["HeLLo"], pooling=read_pooling(checkpoint[0]))
    assert Recording.seen == ["hello ünï", "HeLLo"]
    (path / "sentence_bert_config.json").unlink()
    assert read_pooling(path).max_length is None
    uncut = np.array(embed(model, tokenizer, TEXTS[1]))
    np.testing.assert_allclose(uncut, reference(checkpoint, TEXTS[1:2], "cls", 64), atol=1e-4)
    with pytest.raises(PromptTooLongError, match=r"input\[0\]: \d+ tokens, more than .* 64"):
        embed(model, tokenizer, TEXTS[1] * 3)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_seq_length": 0}, "'max_seq_length' should be a positive int"),
        ({"max_seq_length": "256"}, "'max_seq_length' should be a positive int"),
        ({"max_seq_length": True}, "'max_seq_length' should be a positive int"),
        ({"do_lower_case": "no"}, "'do_lower_case' should be true or false"),
        ([256], "expected a JSON object"),
    ],
)
def test_hostile_sentence_bert_configs_are_one_line(checkpoint, tmp_path, settings, message):
    path = tmp_path / "st"
    path.mkdir()
    shutil.copytree(checkpoint[0] / "1_Pooling", path / "1_Pooling")
    shutil.copy(checkpoint[0] / "modules.json", path)
    (path / "sentence_bert_config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match=message) as e:
        read_pooling(path)
    assert str(e.value).startswith(str(path / "sentence_bert_config.json"))


def test_convert_keeps_the_files_and_q_embeds_near_float(checkpoint, loaded, tmp_path):
    """``convert`` copies sentence-transformers' files; ``-q`` alone on an encoder is uniform
    8-bit (there is no LM head for a plan to measure). The 8-bit model's vectors: transformers'
    on the dequantized weights within 1e-4 (the quantized forward is right), and near the float
    ones by a tolerance derived from the rounding: ``r``, the largest RMS change of a quantized
    tensor relative to its RMS (about a 255th of a group's range / sqrt(12)); through N such
    tensors, each followed by a LayerNorm (gain ~1), the vector moves by about sqrt(N) r, and
    1 - cos ~ (that)^2 / 2; allowed 4x that movement."""
    from mlx.utils import tree_flatten

    from mlxinfer import convert

    out = tmp_path / "q8"
    convert(str(checkpoint[0]), str(out), quantize=True)
    record = json.loads((out / "config.json").read_text())["quantization"]
    assert (record["bits"], record["group_size"]) == (8, 64)
    for name in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json"):
        assert (out / name).read_bytes() == (checkpoint[0] / name).read_bytes(), name
    with pytest.raises(ConfigError, match="'bert' is an encoder"):
        convert(str(checkpoint[0]), str(tmp_path / "plan"), bpw=5.0)
    assert not (tmp_path / "plan").exists()

    model, tokenizer = load(str(out))
    vectors = np.array(embed(model, tokenizer, TEXTS))
    # transformers on the same (dequantized) weights: the reference for the quantized forward.
    import mlx.core as mx

    _, ref_tokenizer, torch_model = checkpoint
    floats = dict(tree_flatten(loaded[0].parameters()))
    relative, n = 0.0, 0
    state = {}
    for path, module in model.named_modules():
        if "scales" in module:
            w = mx.dequantize(
                module["weight"], module["scales"], module["biases"], module.group_size, module.bits
            )
            f = floats[f"{path}.weight"]
            relative = max(relative, float(mx.sqrt(((w - f) ** 2).mean() / (f**2).mean())))
            n += 1
            state[f"{path}.weight"] = torch.tensor(np.array(w))
    assert n == 1 + 2 * 6  # the word embedding and each of the 2 layers' six Linears
    dequantized = type(torch_model)(torch_model.config).eval()
    dequantized.load_state_dict({**torch_model.state_dict(), **state})
    np.testing.assert_allclose(
        vectors, reference((None, ref_tokenizer, dequantized), TEXTS), atol=1e-4
    )
    cosine = (vectors * np.array(embed(*loaded, TEXTS))).sum(1)
    allowed = (4 * np.sqrt(n) * relative) ** 2 / 2
    print(f"8-bit vs float32: cosine {cosine.min():.6f}..{cosine.max():.6f}, r {relative:.2e}")
    assert (1 - cosine <= allowed).all(), (cosine, allowed)


def test_the_embed_command(checkpoint):
    from click.testing import CliRunner

    from mlxinfer.cli.main import cli

    runner = CliRunner()
    path = str(checkpoint[0])
    result = runner.invoke(cli, ["embed", "-m", path, "--json", *TEXTS[:2]])
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    assert got["model"] == path
    np.testing.assert_allclose(got["embeddings"], reference(checkpoint, TEXTS[:2]), atol=1e-4)
    result = runner.invoke(cli, ["embed", "-m", path], input="Hello world\na\n")
    lines = result.output.splitlines()
    assert result.exit_code == 0 and len(lines) == 2
    expected = reference(checkpoint, ["Hello world", "a"])
    np.testing.assert_allclose(
        [[float(x) for x in ln.split()] for ln in lines], expected, atol=1e-4
    )
    result = runner.invoke(cli, ["embed", "-m", path, "--dimensions", "65", "a"])
    assert result.exit_code == 1 and "dimensions: expected an int in 1..64" in result.output


def test_v1_embeddings_serves_a_bert(checkpoint, tmp_path):
    """``--models-dir`` holding the checkpoint: its vectors, long texts cut as the library cuts
    them, the usage counting the tokens embedded."""
    pytest.importorskip("fastapi", reason="the server extra (FastAPI) is not installed")
    from fastapi.testclient import TestClient

    from mlxinfer.server import make_app

    models = tmp_path / "models"
    models.mkdir()
    (models / "minilm").symlink_to(checkpoint[0], target_is_directory=True)
    with TestClient(make_app(models_dir=models)) as client:
        body = {"model": "minilm", "input": TEXTS, "encoding_format": "float"}
        r = client.post("/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        got = [d["embedding"] for d in r.json()["data"]]
        np.testing.assert_allclose(got, reference(checkpoint, TEXTS), atol=1e-4)
        cut = checkpoint[1](TEXTS, truncation=True, max_length=MAX_SEQ_LENGTH)["input_ids"]
        assert r.json()["usage"]["prompt_tokens"] == sum(len(ids) for ids in cut)
        chat = {"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "is an embedding model" in r.json()["error"]["message"]
