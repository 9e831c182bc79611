"""``perplexity`` on tiny random models: transformers' NLL for the truth, numpy for the statistics.

Spec: llama.cpp's protocol (chunks of ``ctx`` evaluated from scratch, the second half scored);
PPL within 0.5 % of exp(transformers' mean NLL) on the same tokens and positions; KLD, its
percentiles, top-1 and RMS Δp as a numpy implementation computes them from the two models'
logits; a model against itself: KLD 0, top-1 100 %; another vocabulary: a one-line error.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hf_models import CORPUS, add_tokenizer, make_tiny

from mlxinfer import load, perplexity
from mlxinfer.cli.main import cli
from mlxinfer.errors import QualityError

CTX, CHUNKS = 32, 5
TEXT = "".join(CORPUS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two random models over one tokenizer (A, B), and one over another vocabulary (C)."""
    root = tmp_path_factory.mktemp("ppl")
    a, torch_a = make_tiny(root / "a", vocab_size=320, seed=0)
    b, _ = make_tiny(root / "b", vocab_size=320, seed=1)
    c, _ = make_tiny(root / "c", vocab_size=300, seed=2)
    add_tokenizer(a), add_tokenizer(b), add_tokenizer(c, vocab_size=300)
    return a, b, c, torch_a


def scored_chunks(path):
    """The chunks the protocol evaluates, the first scored position, and the targets."""
    _, tok = load(path)
    ids = tok.encode(TEXT)
    assert tok.bos_token_id is None  # the tiny tokenizer adds none: chunks are plain slices
    chunks = [ids[i * CTX : (i + 1) * CTX] for i in range(CHUNKS)]
    first = CTX // 2
    return chunks, first, [c[first + 1 :] for c in chunks]


def log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_perplexity_is_exp_of_transformers_mean_nll(tiny):
    a, _, _, torch_a = tiny
    chunks, first, targets = scored_chunks(a)
    nll = []
    for chunk, target in zip(chunks, targets):
        with torch.no_grad():  # each chunk from scratch, logits at first .. CTX-2
            logits = torch_a(torch.tensor([chunk])).logits[0, first:-1].numpy()
        logp = log_softmax(logits)
        nll += (-logp[np.arange(len(target)), target]).tolist()
    report = perplexity(a, text=TEXT, ctx=CTX, chunks=CHUNKS)
    (score,) = report.models
    assert report.chunks == CHUNKS and score.tokens == len(nll) == CHUNKS * (CTX - 1 - first)
    assert score.ppl == pytest.approx(np.exp(np.mean(nll)), rel=5e-3)
    se = np.sqrt((np.mean(np.square(nll)) - np.mean(nll) ** 2) / (len(nll) - 1))
    assert score.ppl_se == pytest.approx(score.ppl * se, rel=1e-2)
    assert report.reference is None and score.kld is None


def test_kld_top1_percentiles_and_delta_p_match_numpy(tiny):
    a, b, _, _ = tiny
    chunks, first, targets = scored_chunks(a)
    (ref, _), (model, _) = load(a), load(b)

    def logp_of(m):
        rows = [np.array(m(mx.array(c)[None])[0, first:-1]) for c in chunks]
        return [log_softmax(r) for r in rows]

    p_ref, p_mod = logp_of(ref), logp_of(model)
    kld = np.concatenate([(np.exp(r) * (r - m)).sum(-1) for r, m in zip(p_ref, p_mod)])
    same = np.concatenate([r.argmax(-1) == m.argmax(-1) for r, m in zip(p_ref, p_mod)])
    pick = [np.arange(len(t)) for t in targets]
    nll_ref = np.concatenate([-r[i, t] for r, i, t in zip(p_ref, pick, targets)])
    nll_mod = np.concatenate([-m[i, t] for m, i, t in zip(p_mod, pick, targets)])
    dp = np.exp(-nll_mod) - np.exp(-nll_ref)

    report = perplexity([b], reference=a, text=TEXT, ctx=CTX, chunks=CHUNKS)
    (s,) = report.models
    assert report.reference.ppl == pytest.approx(np.exp(nll_ref.mean()), rel=1e-4)
    assert s.ppl == pytest.approx(np.exp(nll_mod.mean()), rel=1e-4)
    assert s.kld == pytest.approx(kld.mean(), rel=1e-4)
    assert s.kld_se == pytest.approx(kld.std() / np.sqrt(len(kld) - 1), rel=1e-3)
    assert [s.kld_median, s.kld_p90, s.kld_p99, s.kld_max] == pytest.approx(
        [*np.percentile(kld, [50, 90, 99]), kld.max()], rel=1e-4
    )
    p = same.mean()
    assert 0 < p < 1  # two random models: a real test of agreement, not all or nothing
    assert s.top1_pct == pytest.approx(100 * p)
    assert s.top1_se_pct == pytest.approx(100 * np.sqrt(p * (1 - p) / (len(same) - 1)))
    assert s.rms_dp_pct == pytest.approx(100 * np.sqrt(np.mean(dp**2)), rel=1e-4)
    # (float32 logits: the two means' last digits differ by summation order, ~1e-6 of this)
    assert s.delta_ppl_pct == pytest.approx(
        100 * (np.exp(nll_mod.mean() - nll_ref.mean()) - 1), rel=1e-4
    )


def test_a_model_against_itself_diverges_by_nothing(tiny):
    a = tiny[0]
    (s,) = perplexity(a, reference=a, text=TEXT, ctx=CTX, chunks=2).models
    assert s.kld == pytest.approx(0, abs=1e-6) and s.kld_max == pytest.approx(0, abs=1e-5)
    assert s.top1_pct == 100 and s.rms_dp_pct == pytest.approx(0, abs=1e-6)
    assert s.delta_ppl_pct == pytest.approx(0, abs=1e-9)
    assert s.bytes == sum(f.stat().st_size for f in a.glob("model*.safetensors"))
    assert s.parameters == sum(p.numel() for p in tiny[3].parameters())  # unquantized shapes
    assert s.bits_per_weight == pytest.approx(32, rel=0.01)  # float32, a small header


def test_cli_prints_a_row_per_model_and_json(tiny, tmp_path):
    a, b, _, _ = tiny
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = ["perplexity", "-m", str(a), "-m", str(b), "--reference", str(a), "--text", str(text)]
    args += ["--ctx", str(CTX), "--chunks", "2"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and lines[0].startswith("model") and "KLD" in lines[0]
    assert "(reference)" in lines[1] and lines[3].startswith(str(b))
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [m["model"] for m in report["models"]] == [str(a), str(b)]
    assert report["reference"]["model"] == str(a) and report["chunks"] == 2


def test_another_vocabulary_is_refused_in_one_line(tiny):
    a, _, c, _ = tiny
    with pytest.raises(QualityError, match="another vocabulary") as e:
        perplexity(a, reference=c, text=TEXT, ctx=CTX, chunks=1)
    assert "\n" not in str(e.value) and str(c) in str(e.value)
    result = CliRunner().invoke(cli, ["perplexity", "-m", str(a), "--reference", str(c)])
    assert result.exit_code != 0 and "another vocabulary" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_text_shorter_than_one_chunk_is_refused(tiny):
    with pytest.raises(QualityError, match="fewer than one chunk of ctx 256"):
        perplexity(tiny[0], text="Hello world.", ctx=256)


def test_a_chunk_past_the_models_context_is_refused(tiny):
    """The tiny models' context is 256 positions: a 257-token chunk would run past it."""
    with pytest.raises(
        QualityError, match="ctx 257 is past the model's context, expected at most 256"
    ):
        perplexity(tiny[0], text=TEXT * 20, ctx=257)


def test_a_text_file_that_is_not_utf8_is_named(tiny, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine text \xff\xfe then")
    result = CliRunner().invoke(cli, ["perplexity", "-m", str(tiny[0]), "--text", str(bad)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{bad}: expected UTF-8 text, found byte 0xff at offset 10" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_default_text_is_the_evaluation_corpus_spread_over_its_chunks(tiny):
    """No text: the evaluation corpus's documents (chats through the template), --chunks of it
    spread evenly: the second of two chunks starts half-way through."""
    from mlxinfer.quant.corpus import document_tokens, evaluation_documents

    a = tiny[0]
    model, tok = load(a)
    tokens = document_tokens(tok, evaluation_documents(tok))
    report = perplexity(a, ctx=CTX, chunks=2)
    assert report.text_tokens == len(tokens) > 50_000 and report.chunks == 2
    first, nll = CTX // 2, []
    for start in (0, len(tokens) // CTX // 2 * CTX):
        chunk = tokens[start : start + CTX]
        logp = log_softmax(np.array(model(mx.array(chunk)[None])[0, first:-1]))
        nll += (-logp[np.arange(CTX - 1 - first), chunk[first + 1 :]]).tolist()
    assert report.models[0].ppl == pytest.approx(np.exp(np.mean(nll)), rel=1e-4)
