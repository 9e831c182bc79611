"""Embeddings (mlxinfer/embeddings.py, mlxinfer/server/embeddings/): a tiny random ``qwen3``
embedding checkpoint saved by transformers' ``AutoModel`` (bare weight names, as
Qwen3-Embedding ships), with sentence-transformers' pooling files and a tokenizer whose
post-processor appends ``<|endoftext|>``. The reference is transformers itself: each text
alone through ``AutoModel``, its last (or mean, or first) hidden state, L2-normalised."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from hf_models import TINY, add_tokenizer

from mlxinfer import embed, load
from mlxinfer.embeddings import EmbeddingError, Pooling, embed_ids, read_pooling
from mlxinfer.errors import (
    ConfigError,
    MlxInferError,
    PromptTooLongError,
    TokenIdError,
    WeightsError,
)

TEXTS = [
    "Hello world",
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog.",
    "a",
    "naïve café 東京 🙂 def f(x): return x * 2",
]
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]
MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens")


def pooling_config(mode: str = "lasttoken") -> dict:
    """1_Pooling/config.json as sentence-transformers writes it (Qwen3-Embedding's: lasttoken)."""
    config = {"word_embedding_dimension": TINY["hidden_size"]}
    config.update({f"pooling_mode_{m}": False for m in (*MODES, "lasttoken")})
    config[f"pooling_mode_{mode}"] = True
    return {**config, "include_prompt": True}


def write_pooling(path: Path, modules=MODULES, config=None) -> Path:
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config or pooling_config()))
    (path / "modules.json").write_text(json.dumps(modules))
    return path


def write_checkpoint(path: Path, tied: bool = True) -> tuple:
    """(directory, transformers' tokenizer and base model) of an embedding checkpoint saved by
    ``AutoModel`` (``Qwen3Model``: no LM head), its embedding tied or not."""
    path.mkdir()
    torch.manual_seed(0)
    overrides = {**TINY, "vocab_size": 320, "tie_word_embeddings": tied}
    config = transformers.AutoConfig.for_model("qwen3", **overrides)
    model = transformers.AutoModel.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    add_tokenizer(path)
    # Qwen3-Embedding's tokenizer.json appends <|endoftext|> (the token it pools) to every text.
    spec = json.loads((path / "tokenizer.json").read_text())
    eos = next(t["id"] for t in spec["added_tokens"] if t["content"] == "<|endoftext|>")
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [eos], "tokens": ["<|endoftext|>"]}
        },
    }
    (path / "tokenizer.json").write_text(json.dumps(spec))
    write_pooling(path)
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return path, reference_tokenizer, model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The embedding checkpoint, its embedding tied (Qwen3-Embedding-0.6B)."""
    return write_checkpoint(tmp_path_factory.mktemp("embedding") / "tiny-embedding")


@pytest.fixture(scope="module")
def headless(tmp_path_factory):
    """Untied, and saved without an LM head (Qwen3-Embedding-4B and -8B)."""
    return write_checkpoint(tmp_path_factory.mktemp("headless") / "tiny-untied", tied=False)


def reference(checkpoint, texts, mode="lasttoken", dimensions=None) -> np.ndarray:
    """transformers' vectors: each text alone (no padding), pooled, truncated, normalised."""
    _, tokenizer, model = checkpoint
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0]  # (L, hidden)
        v = {"lasttoken": h[-1], "mean": h.mean(0), "cls": h[0]}[mode][:dimensions]
        out.append(torch.nn.functional.normalize(v, dim=-1).numpy())
    return np.stack(out)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load(str(checkpoint[0]))


def test_the_tokenizer_appends_eos_as_the_checkpoint_says(checkpoint, loaded):
    _, tokenizer, _ = checkpoint
    ids = tokenizer("Hello world")["input_ids"]
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert loaded[1].encode("Hello world") == ids


def test_embed_matches_transformers_in_one_batch_of_mixed_lengths(checkpoint, loaded):
    model, tokenizer = loaded
    vectors = np.array(embed(model, tokenizer, TEXTS))
    assert vectors.shape == (len(TEXTS), TINY["hidden_size"]) and vectors.dtype == np.float32
    np.testing.assert_allclose(vectors, reference(checkpoint, TEXTS), atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # One string, and ids given as such, are the same vectors.
    np.testing.assert_allclose(
        np.array(embed(model, tokenizer, TEXTS[1]))[0], vectors[1], atol=1e-6
    )
    ids = [tokenizer.encode(t) for t in TEXTS]
    np.testing.assert_allclose(np.array(embed(model, tokenizer, ids)), vectors, atol=1e-6)


def test_an_untied_checkpoint_without_lm_head_embeds_as_transformers(headless):
    """Its weights have no ``lm_head.weight`` (nor the ``model.`` prefix): it loads, and its
    vectors are transformers' last-token pooled, normalised ones."""
    from safetensors import safe_open

    path = headless[0]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Model"] and config["tie_word_embeddings"] is False
    with safe_open(path / "model.safetensors", "np") as f:
        keys = set(f.keys())
    assert "embed_tokens.weight" in keys and not any(k.startswith("lm_head") for k in keys)
    model, tokenizer = load(str(path))
    vectors = np.array(embed(model, tokenizer, TEXTS))
    np.testing.assert_allclose(vectors, reference(headless, TEXTS), atol=1e-4)


def test_without_a_head_only_an_embedding_checkpoint_loads(headless, tmp_path):
    """The same weights without sentence-transformers' files are a generative checkpoint
    missing its head; weights with no usable body are an error too: one line each, naming the
    file and the key."""
    import shutil

    from safetensors.numpy import load_file, save_file

    plain = tmp_path / "plain"
    shutil.copytree(headless[0], plain, ignore=shutil.ignore_patterns("modules.json"))
    with pytest.raises(WeightsError) as e:
        load(str(plain))
    assert str(e.value) == f"{plain / 'model.safetensors'}: missing weight 'lm_head.weight'"
    bodiless = tmp_path / "bodiless"
    shutil.copytree(headless[0], bodiless)
    weights = load_file(bodiless / "model.safetensors")
    weights = {f"encoder.{k}": v for k, v in weights.items()}  # no body our model knows
    save_file(weights, bodiless / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MlxInferError) as e:
        load(str(bodiless))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{bodiless / 'model.safetensors'}: unexpected weight 'encoder.")


@pytest.mark.parametrize("mode", ["lasttoken", "mean", "cls"])
def test_pooling_modes_and_long_rows_in_chunks(checkpoint, loaded, mode):
    """Rows longer than ``step`` run in chunks through a KV cache; small ``batch_tokens`` makes
    several batches: the vectors are the same as transformers' either way."""
    model, tokenizer = loaded
    ids = [tokenizer.encode(t) for t in TEXTS]
    vectors = embed_ids(model, ids, Pooling(mode), step=4, batch_tokens=40)
    np.testing.assert_allclose(np.array(vectors), reference(checkpoint, TEXTS, mode), atol=1e-4)


def test_dimensions_truncate_then_normalise(checkpoint, loaded):
    vectors = np.array(embed(*loaded, TEXTS, dimensions=16))
    np.testing.assert_allclose(vectors, reference(checkpoint, TEXTS, dimensions=16), atol=1e-4)
    for bad in (0, 65, True, 2.0):
        with pytest.raises(EmbeddingError, match="dimensions"):
            embed(*loaded, TEXTS, dimensions=bad)


def test_library_inputs_are_checked(loaded):
    model, tokenizer = loaded
    cases = [
        ([], EmbeddingError, "input"),
        ([[]], EmbeddingError, r"input\[0\]: empty"),
        (["a", 3], EmbeddingError, r"input\[1\]"),
        ([[1, 2], "a"], EmbeddingError, r"input\[1\]"),
        ([[1, 320]], TokenIdError, r"input\[0\].*320"),
        ([[5], [-1]], TokenIdError, r"input\[1\]"),
        ([[1] * 257], PromptTooLongError, r"input\[0\]: 257 tokens.*256"),
    ]
    for texts, error, message in cases:
        with pytest.raises(error, match=message):
            embed(model, tokenizer, texts)


@pytest.mark.parametrize(
    "modules, config, message",
    [
        ({"a": 1}, None, "modules.json: expected a list"),
        ([{"type": 3}], None, "module 0 should be an object"),
        ([{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}], None, "Dense"),
        (MODULES[:1], None, "no sentence_transformers.models.Pooling module"),
        ([{**MODULES[1], "path": "../../etc"}], None, "should name a subdirectory"),
        (MODULES, {"pooling_mode_lasttoken": "yes"}, "'pooling_mode_lasttoken' should be true"),
        (MODULES, {"pooling_mode_max_tokens": True}, "'pooling_mode_max_tokens' is not supported"),
        (MODULES, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "found 2"),
        (MODULES, {}, "exactly one of"),
        (MODULES, [1], "expected a JSON object"),
        (MODULES, {**pooling_config(), "word_embedding_dimension": -3}, "word_embedding_dimension"),
    ],
)
def test_hostile_pooling_configs_are_config_errors_naming_the_file(
    tmp_path, modules, config, message
):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps(config if config is not None else pooling_config())
    )
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match=message):
        read_pooling(tmp_path)


def test_pooling_files_that_are_not_json_or_too_large(tmp_path):
    write_pooling(tmp_path)
    (tmp_path / "modules.json").write_text("[" * 100_000)
    with pytest.raises(ConfigError, match="modules.json: larger than"):
        read_pooling(tmp_path)
    (tmp_path / "modules.json").write_text("{not json")
    with pytest.raises(ConfigError, match="modules.json: not valid JSON"):
        read_pooling(tmp_path)
    with pytest.raises(ConfigError, match="modules.json: missing"):
        read_pooling(tmp_path / "1_Pooling")
    write_pooling(tmp_path, config={"pooling_mode_lasttoken": True})
    assert read_pooling(tmp_path) == Pooling("lasttoken", True, None)
    write_pooling(tmp_path, modules=MODULES[:2], config=pooling_config("mean_tokens"))
    assert read_pooling(tmp_path) == Pooling("mean", False, TINY["hidden_size"])


# --- the server ----------------------------------------------------------------------------------

KEY, GEN = "sk-local-test", "gen"


@pytest.fixture(scope="module")
def server(checkpoint, loaded):
    """A server with a generative model ("gen") and the embedding checkpoint under its name."""
    pytest.importorskip("fastapi", reason="the server extra (FastAPI) is not installed")
    pytest.importorskip("uvicorn", reason="the server extra (uvicorn) is not installed")
    from servers import serving

    from mlxinfer.server import make_app

    model, tokenizer = loaded  # the same weights serve as a generative model too
    app = make_app(
        model,
        tokenizer,
        GEN,
        api_key=KEY,
        max_batch=2,
        kv_budget=1 << 22,
        embedding_model=str(checkpoint[0]),
    )
    with serving(app) as url:
        yield url, checkpoint[0].name
    while _http:
        _http.pop().close()


_http = []  # one client for the module: making one (its TLS context) costs ~0.2 s


def _post(url, path, body):
    import httpx

    if not _http:
        _http.append(httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60))
    return _http[0].post(f"{url}{path}", json=body)


def test_the_openai_client_gets_transformers_vectors(server, checkpoint):
    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    url, name = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    expected = reference(checkpoint, TEXTS)
    floats = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS))) and floats.model == name
    np.testing.assert_allclose([d.embedding for d in floats.data], expected, atol=1e-4)
    tokens = sum(len(checkpoint[1](t)["input_ids"]) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    # The client asks for base64 unless told otherwise, and decodes it itself.
    default = client.embeddings.create(model=name, input=TEXTS)
    np.testing.assert_array_equal(
        [d.embedding for d in default.data], [d.embedding for d in floats.data]
    )
    short = client.embeddings.create(model=name, input=TEXTS[0], dimensions=16)
    np.testing.assert_allclose(
        short.data[0].embedding, reference(checkpoint, TEXTS[:1], dimensions=16)[0], atol=1e-4
    )
    assert name in [m.id for m in client.models.list()]


def test_base64_is_little_endian_float32_of_the_same_numbers(server):
    url, name = server
    ids = [[5, 6, 7], [9]]
    floats = _post(url, "/v1/embeddings", {"model": name, "input": ids}).json()
    packed = _post(
        url,
        "/v1/embeddings",
        {"model": name, "input": ids, "encoding_format": "base64", "user": "u1"},
    ).json()
    for f, b in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(f["embedding"], dtype=np.float32))
    assert floats["usage"] == {"prompt_tokens": 4, "total_tokens": 4}


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"input": "x"}, "model", "model"),
        ({"model": "@"}, "input", "input: required"),
        ({"model": "@", "input": 5}, "input", "found int"),
        ({"model": "@", "input": []}, "input", "found an empty list"),
        ({"model": "@", "input": {"a": 1}}, "input", "found dict"),
        ({"model": "@", "input": ["a", ["b"]]}, "input", r"input[1]"),
        ({"model": "@", "input": [[1, 2.5]]}, "input", r"input[0]: item 1"),
        ({"model": "@", "input": [[1], [320]]}, "input", r"input[1]: token id 320"),
        ({"model": "@", "input": [[-1]]}, "input", r"input[0]: token id -1"),
        ({"model": "@", "input": [[True]]}, "input", r"input[0]: item 0"),
        ({"model": "@", "input": [[1] * 257]}, "input", r"input[0]: 257 tokens"),
        ({"model": "@", "input": ["x" * 5000]}, "input", r"input[0]: 5000 characters"),
        ({"model": "@", "input": ["a"] * 2049}, "input", "2049 items, at most 2048"),
        ({"model": "@", "input": "a", "encoding_format": "int8"}, "encoding_format", "'int8'"),
        ({"model": "@", "input": "a", "dimensions": 65}, "dimensions", "1..64"),
        ({"model": "@", "input": "a", "dimensions": "8"}, "dimensions", "found '8'"),
        ({"model": "@", "input": "a", "dimensions": 0}, "dimensions", "found 0"),
        ({"model": GEN, "input": "a"}, "model", "not an embedding model"),
    ],
)
def test_hostile_requests_are_400s_in_openais_shape(server, body, param, message):
    url, name = server
    if body.get("model") == "@":
        body = {**body, "model": name}
    r = _post(url, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"], error["message"]


def test_too_many_tokens_in_all_and_the_other_kinds_of_request(server, monkeypatch):
    from mlxinfer.server.embeddings import routes

    url, name = server
    monkeypatch.setattr(routes, "MAX_REQUEST_TOKENS", 5)
    r = _post(url, "/v1/embeddings", {"model": name, "input": [[1, 2, 3], [4, 5, 6]]})
    assert r.status_code == 400 and "6 tokens in all, at most 5" in r.json()["error"]["message"]
    r = _post(url, "/v1/embeddings", {"model": "nope", "input": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = _post(url, "/v1/chat/completions", chat)
    assert r.status_code == 400 and "is an embedding model" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "model"
    r = _post(url, "/v1/messages", {**chat, "model": name})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = _post(url, "/v1/chat/completions", {**chat, "model": GEN})
    assert r.status_code == 200  # the generative model still answers


def test_models_dir_serves_an_embedding_checkpoint_under_its_name(checkpoint, tmp_path):
    from fastapi.testclient import TestClient

    from mlxinfer.server import make_app

    models = tmp_path / "models"
    models.mkdir()
    (models / "emb").symlink_to(checkpoint[0], target_is_directory=True)
    app = make_app(models_dir=models)
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["emb"]
        r = client.post(
            "/v1/embeddings", json={"model": "emb", "input": TEXTS, "encoding_format": "float"}
        )
        assert r.status_code == 200, r.text
        got = [d["embedding"] for d in r.json()["data"]]
        np.testing.assert_allclose(got, reference(checkpoint, TEXTS), atol=1e-4)
        metrics = client.get("/metrics").text
        assert 'mlxinfer_requests_done_total{model="emb"} 1' in metrics
        assert client.get("/health").json()["models"]["emb"]["loaded"]


def test_concurrent_requests_each_get_their_own_vectors(server, checkpoint):
    """Embedding requests from several threads (one forward at a time) while a chat request
    runs on the generative model's engine: each gets the vectors of its own inputs."""
    from concurrent.futures import ThreadPoolExecutor

    url, name = server
    expected = reference(checkpoint, TEXTS)
    chat = {"model": GEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    def one(i):
        if i == 0:
            return _post(url, "/v1/chat/completions", chat).status_code
        texts = [TEXTS[i % 4], TEXTS[(i + 1) % 4]]
        r = _post(
            url, "/v1/embeddings", {"model": name, "input": texts, "encoding_format": "float"}
        )
        got = [d["embedding"] for d in r.json()["data"]]
        np.testing.assert_allclose(got, expected[[i % 4, (i + 1) % 4]], atol=1e-4)
        return r.status_code

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(6))) == [200] * 6
