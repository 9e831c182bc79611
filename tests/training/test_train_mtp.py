"""``mlxinfer train-mtp``: a head trained here for a model that ships none (training/mtp.py).

The objective is checked by derivation: at step 0 the head passes the trunk's final states
through (its residual branches start at zero, ``eh_proj`` at ``[0, I]``, and a random
checkpoint's norms are ones), so its distribution for x_{j+2} is the trunk's for x_{j+1} and the
held-out KL must equal ``KL(p_{j+1} || p_j)`` computed from the trunk's own logits in numpy. A
pair off by one position, or the KL's direction swapped, fails it. Training must lower that KL
and raise the drafts accepted, and drafting with the head stays exact (plain greedy's tokens)."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors import safe_open
from tiny_checkpoint import write_checkpoint

from mlxinfer.cli.main import cli
from mlxinfer.errors import DraftError
from mlxinfer.generation import generate_step
from mlxinfer.generation.mtp_drafts import MTP
from mlxinfer.generation.speculative import speculative_generate_step
from mlxinfer.loading.loader import load
from mlxinfer.models import build_model
from mlxinfer.models.layers.mtp import HEAD_FILE, attach_head
from mlxinfer.training import mtp as training

PROMPTS = ["the quick brown fox", "hello world", "lazy dog jumps", "brown fox and dog"]
SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "m", **SIZE)


def kl_from_logits(logits: np.ndarray, k: int = 32, shift: int = 1) -> np.ndarray:
    """KL(p_{j+shift} || p_j) over p_{j+shift}'s k likeliest tokens for each pair j, in
    float64."""
    z = logits.astype(np.float64)
    m = z.max(-1, keepdims=True)
    logp = z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))
    p, q = logp[shift:], logp[:-shift]
    top = np.argsort(-p, axis=-1)[:, :k]
    pt, qt = np.take_along_axis(p, top, -1), np.take_along_axis(q, top, -1)
    return (np.exp(pt) * (pt - qt)).sum(-1)


def test_the_untrained_heads_kl_is_the_trunks_own_shift(tiny, monkeypatch):
    model, tokenizer = load(str(tiny))
    seqs = training.generate_sequences(model, tokenizer, PROMPTS, max_tokens=12, seed=0)

    def fake_generate(*args, **kwargs):
        return seqs

    monkeypatch.setattr(training, "generate_sequences", fake_generate)
    report = training.train_mtp(
        model,
        tokenizer,
        output=tiny.parent / "h0.safetensors",
        prompts=PROMPTS,
        steps=1,
        learning_rate=1e-9,
        draft_vocab=0,  # the whole vocabulary: the derivation's softmax
    )
    # Held out: the first prompt of a seeded permutation (an eighth, at least one), both answers.
    mx.random.seed(0)
    first = mx.random.permutation(len(PROMPTS)).tolist()[0]
    rows = [seqs[2 * first], seqs[2 * first + 1]]
    logits = [np.array(model(mx.array(r)[None])[0]) for r in rows]
    # The rows' means, averaged (held_out weighs each batch's pair-mean by its rows; the two
    # answers share one batch, so this is the mean over every pair of the batch).
    want = np.concatenate([kl_from_logits(z) for z in logits]).mean()
    assert report.kl_before == pytest.approx(want, rel=1e-3, abs=1e-5)
    assert report.kl_before > 0.01  # the check says something: the shift is not nothing
    # Chained (the head fed its own output g_j with x_{j+2}): the identity head gives p_j
    # again, scored against the trunk's distribution two tokens on.
    want2 = np.concatenate([kl_from_logits(z, shift=2) for z in logits]).mean()
    assert report.kl_chained_before == pytest.approx(want2, rel=1e-3, abs=1e-5)
    assert abs(report.kl_chained_before - report.kl_before) > 0.01  # one shift is not the other


def accepted(model, draft, prompt, n=24):
    """(tokens, drafts accepted) of greedy speculative decoding at one draft per step."""
    tokens, hits = [], 0
    for step in speculative_generate_step(prompt, model, draft, num_draft=1, max_tokens=n):
        tokens.append(int(step[0]))
        hits += bool(step[2])
    return tokens, hits


def test_training_lowers_the_kl_and_its_drafts_are_accepted_and_exact(tiny, tmp_path):
    model, tokenizer = load(str(tiny))
    untrained = tmp_path / "untrained.safetensors"
    training.train_mtp(
        model,
        tokenizer,
        output=untrained,
        prompts=PROMPTS,
        max_tokens=8,
        steps=1,
        learning_rate=1e-9,
    )
    report = training.train_mtp(
        model,
        tokenizer,
        prompts=PROMPTS * 4,
        max_tokens=24,
        steps=60,
        learning_rate=3e-3,
        top_k=300,
    )  # the whole vocabulary
    assert report.path == tiny / HEAD_FILE and report.path.is_file()  # beside the model
    assert report.kl_after < 0.8 * report.kl_before
    assert report.kl_chained_after < 0.8 * report.kl_chained_before  # the second draft's too
    with safe_open(str(report.path), "np") as f:
        meta = f.metadata()
    assert meta["format"] == "mlxinfer-mtp-head" and meta["hidden_size"] == "64"
    fresh, _ = load(str(tiny))  # the head file beside the weights is not read as weights
    prompt = tokenizer.encode(PROMPTS[0])
    plain = [int(s[0]) for s in generate_step(prompt, fresh, max_tokens=24)]
    tokens, hits = accepted(fresh, MTP(), prompt)  # finds mtp_head.safetensors beside it
    assert tokens == plain
    other, _ = load(str(tiny))
    _, hits_before = accepted(other, MTP(head=untrained), prompt)
    assert hits > hits_before + 3, (hits, hits_before)


# --- The CLI: train-mtp, then --mtp finds the head beside the model, --mtp-head elsewhere ----


def test_cli_train_mtp_then_generate_with_the_head(tiny, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny, model, ignore=shutil.ignore_patterns(HEAD_FILE))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    train = ["train-mtp", str(model), "--prompts", str(prompts), "--max-tokens", "8"]
    result = CliRunner().invoke(cli, train + ["--steps", "3"])
    assert result.exit_code == 0, result.stderr
    assert "held-out top-1 agreement" in result.stdout and (model / HEAD_FILE).is_file()
    base = ["generate", "-m", str(model), "-p", "hello world", "-n", "12"]
    plain = CliRunner().invoke(cli, base)
    drafted = CliRunner().invoke(cli, base + ["--mtp", "-v"])
    assert drafted.exit_code == 0, drafted.stderr
    assert drafted.stdout == plain.stdout and "draft accepted" in drafted.stderr
    elsewhere = tmp_path / "heads" / "h.safetensors"
    result = CliRunner().invoke(cli, train + ["--steps", "2", "-o", str(elsewhere)])
    assert result.exit_code == 0 and elsewhere.is_file(), result.stderr
    (model / HEAD_FILE).unlink()
    drafted = CliRunner().invoke(cli, base + ["--mtp-head", str(elsewhere)])
    assert drafted.exit_code == 0 and drafted.stdout == plain.stdout, drafted.stderr
    result = CliRunner().invoke(cli, base + ["--mtp"])  # no head beside it now
    assert result.exit_code == 1 and "train-mtp" in result.stderr


# --- One-line errors --------------------------------------------------------------------------


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_a_head_for_another_model_or_not_a_head_is_refused(tiny, tmp_path):
    model, tokenizer = load(str(tiny))
    other_dir = write_checkpoint(tmp_path / "other", **{**SIZE, "hidden_size": 32})
    other, _ = load(str(other_dir))
    head = tmp_path / "h.safetensors"
    training.train_mtp(other, tokenizer, output=head, prompts=PROMPTS, max_tokens=4, steps=1)
    with pytest.raises(DraftError) as e:
        attach_head(model, head)
    assert "'hidden_size'" in one_line(e) and str(head) in one_line(e)
    with pytest.raises(DraftError) as e:
        attach_head(model, tiny / "model.safetensors")  # weights, not a head
    assert "'format'" in one_line(e)
    with pytest.raises(DraftError) as e:
        attach_head(model, tmp_path / "missing.safetensors")
    assert "not an MTP head file" in one_line(e)
    attach_head(other, head)
    with pytest.raises(DraftError) as e:  # it has one now
        training.train_mtp(other, tokenizer, output=head, prompts=PROMPTS, steps=1)
    assert "already has MTP heads" in one_line(e)


def test_a_family_a_head_cannot_fit_is_refused(tmp_path):
    """GPT-2's blocks take no cache-made mask and its logits are its own: no trained head."""
    config = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, "vocab_size": 100}
    model = build_model({**config, "n_positions": 64})
    with pytest.raises(DraftError) as e:
        training.train_mtp(model, None, output=tmp_path / "h.safetensors", prompts=PROMPTS)
    assert "'gpt2'" in one_line(e)


def test_the_draft_vocabulary_reads_only_its_rows_of_the_lm_head(tiny, tmp_path):
    """A trained head drafts over the tokens the model wrote most: its logits are the LM head's
    for those ids (the same rows, quantized or not) and -inf for the rest."""
    import mlx.nn as nn

    from mlxinfer.models.layers.mtp import draft_vocab_logits

    model, _ = load(str(tiny))
    ids = mx.array([7, 3, 250, 42], dtype=mx.int32)
    g = mx.random.normal((1, 2, 64))
    for quantized in (False, True):
        if quantized:
            nn.quantize(model, group_size=32, bits=4)
        full = model.head_logits(g)
        part = draft_vocab_logits(model, ids)(g)
        assert mx.allclose(part[..., ids], full[..., ids], atol=1e-4).item()
        outside = np.setdiff1d(np.arange(full.shape[-1]), np.array(ids))
        rest = np.array(part)[..., outside]
        assert np.isneginf(rest).all()
    head = tmp_path / "h.safetensors"
    fresh, tokenizer = load(str(tiny))
    training.train_mtp(fresh, tokenizer, output=head, prompts=PROMPTS, max_tokens=4, steps=1)
    weights = dict(mx.load(str(head)))
    assert weights["draft_vocab"].size < 300  # the ids the answers used, not the vocabulary
    weights["draft_vocab"] = mx.array([1, 300], dtype=mx.int32)
    mx.save_safetensors(str(head), weights, metadata=safe_open(str(head), "np").metadata())
    with pytest.raises(DraftError) as e:
        attach_head(fresh, head)
    assert "ids outside 0..299" in one_line(e)


def test_bad_settings_and_a_truncated_head_are_one_line_errors(tiny, tmp_path):
    """NaN or non-positive learning rates, zero steps, a negative or infinite chain weight, and a
    head file cut short: our error in one line (the file checked before MLX maps it), nothing
    written."""
    model, tokenizer = load(str(tiny))
    out = tmp_path / "h.safetensors"
    bads = ({"learning_rate": float("nan")}, {"learning_rate": -1.0}, {"steps": 0})
    for bad in (*bads, *({"chain_weight": w} for w in (-0.5, float("inf"), float("nan")))):
        with pytest.raises(DraftError) as e:
            training.train_mtp(model, tokenizer, output=out, prompts=PROMPTS, **bad)
        assert "train-mtp" in one_line(e) and not out.exists()
    training.train_mtp(model, tokenizer, output=out, prompts=PROMPTS, max_tokens=4, steps=1)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(out.read_bytes()[: out.stat().st_size // 2])
    with pytest.raises(DraftError) as e:
        attach_head(model, cut)
    assert "not an MTP head file" in one_line(e) and str(cut) in one_line(e)
    result = CliRunner().invoke(cli, ["train-mtp", str(tiny), "--batch-size", "100000"])
    assert result.exit_code == 2 and "--batch-size" in result.stderr
    for bad in ("nan", "inf"):  # click's range lets them through: ours, one line, nothing written
        result = CliRunner().invoke(
            cli,
            [
                "train-mtp",
                str(tiny),
                "-o",
                str(tmp_path / "bad.safetensors"),
                "--chain-weight",
                bad,
            ],
        )
        assert result.exit_code == 1 and "chain weight" in result.stderr, result.stderr
        assert not (tmp_path / "bad.safetensors").exists()
        assert len(result.stderr.strip().splitlines()) == 1
