"""Perplexity, and KL divergence against a reference, on the same tokens for every model.

The protocol is llama.cpp's ``llama-perplexity``, so numbers line up with published tables:

* the text is tokenized once, by the first model's tokenizer (every model must share it);
  without a text, the evaluation corpus shipped in ``texts/`` (corpus.py): its documents, the
  conversations rendered through that tokenizer's chat template, each tokenized on its own and
  joined (:func:`~mlxinfer.quant.corpus.document_tokens`);
* the tokens are cut into chunks of ``ctx`` (of the shipped corpus, ``chunks`` spread evenly
  over all of it, so a short run still sees each kind of text; of a given text, the first); each chunk is evaluated from scratch (no cache
  carried over), its first token replaced by BOS when the tokenizer adds one;
* only the second half is scored: the logits at positions ``ctx/2 .. ctx-2`` predict tokens
  ``ctx/2+1 .. ctx-1`` (``ctx - 1 - ctx/2`` tokens a chunk), each with an f32 log-softmax.

Per model: perplexity ``exp(mean NLL)`` ± ``ppl * SE(NLL)``. Against a reference, per scored
token: ``KLD(ref || model) = sum_v p_ref(v) * (log p_ref(v) - log p_model(v))``, whether both
put their highest probability on the same token, and ``Δp = p_model(next) - p_ref(next)`` for the
token that actually follows (llama.cpp's Δp). Differences from llama.cpp: the KLD sums every
vocabulary entry in f32 (llama.cpp stores the reference's log-probs as 16-bit and drops terms
with ``log p_ref < -16``), and the percentiles interpolate linearly (numpy's default).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..errors import QualityError
from ..loading.loader import load, open_model, weight_files
from ..models import build_model
from ..models.config import read_config
from ..quant.corpus import document_tokens, evaluation_documents

# Measured on 2 shared CPU cores: SmolLM2-135M (its Q4_1 GGUF) evaluates a 512-token chunk in about
# 1.5 s, and a chunk of it against itself as reference in about 3.5 s: 16 chunks (4,080 scored
# tokens) take about 25 s for one model, about a minute for a model and its reference.
DEFAULT_CHUNKS = 16


@dataclass
class Score:
    """One model's numbers on the scored tokens. The fields after ``ppl_se`` are None for the
    reference itself and when there is no reference; percentages are 0..100."""

    model: str
    bytes: int  # of the weight files on disk (model*.safetensors)
    parameters: int  # of the unquantized shapes (weight_bytes_and_parameters)
    bits_per_weight: float  # bytes * 8 / parameters
    tokens: int  # scored
    ppl: float
    ppl_se: float
    delta_ppl_pct: float | None = None  # (PPL / PPL_ref - 1) * 100, on the same tokens
    kld: float | None = None  # mean KLD(ref || model), nats per token
    kld_se: float | None = None
    kld_median: float | None = None
    kld_p90: float | None = None
    kld_p99: float | None = None
    kld_max: float | None = None
    top1_pct: float | None = None  # same top token as the reference
    top1_se_pct: float | None = None
    rms_dp_pct: float | None = None  # sqrt(mean(Δp²)), Δp of the next token's probability


@dataclass
class PerplexityReport:
    """What :func:`perplexity` measured: the protocol, the reference's score, one per model."""

    text_tokens: int
    ctx: int
    chunks: int
    reference: Score | None
    models: list[Score] = field(default_factory=list)


def perplexity(
    models: str | os.PathLike | Sequence[str | os.PathLike],
    reference: str | os.PathLike | None = None,
    *,
    text: str | None = None,
    ctx: int = 512,
    chunks: int | None = DEFAULT_CHUNKS,
    log: Callable[[str], None] | None = None,
) -> PerplexityReport:
    """Score ``models`` (and ``reference``) on the same tokens of ``text``.

    Args:
        models: one model or several, each anything :func:`mlxinfer.load` takes but the default
            model: a directory, a Hub repo id, a ``.gguf`` file.
        reference: the model the others are compared with (KL divergence, top-1, Δp, ΔPPL).
        text: the text to score; None: the evaluation corpus shipped in ``mlxinfer/quant/texts``
            (chats through the first model's chat template), ``chunks`` of it spread evenly.
        ctx: tokens per chunk (llama.cpp's ``-c``); the second half of each is scored.
        chunks: at most this many chunks (None: every whole chunk of the text).
        log: receives loading and progress messages.

    All models are loaded at once and evaluated chunk by chunk, one chunk's logits at a time:
    memory is the models plus one ``ctx`` x vocabulary block of logits per model.
    """
    if ctx < 4:
        raise QualityError(f"ctx must be at least 4 tokens, found {ctx}")
    paths = [models] if isinstance(models, (str, os.PathLike)) else list(models)
    if not paths:
        raise QualityError("perplexity needs at least one model")
    specs = ([reference] if reference is not None else []) + paths
    loaded = [_Model.open(p, log) for p in specs]
    tokenizer = loaded[len(specs) - len(paths)].tokenizer  # the first model's
    for m in loaded:
        _check_vocabulary(tokenizer, m)
        context = getattr(getattr(m.model, "args", None), "max_position_embeddings", None)
        if isinstance(context, int) and ctx > context:
            raise QualityError(
                f"{m.name}: ctx {ctx} is past the model's context, expected at most {context} "
                "(max_position_embeddings)"
            )
    if text is None:
        tokens = document_tokens(tokenizer, evaluation_documents(tokenizer))
    else:
        tokens = tokenizer.encode(text)
    whole = len(tokens) // ctx
    if whole == 0:
        raise QualityError(f"the text is {len(tokens)} tokens, fewer than one chunk of ctx {ctx}")
    n = whole if chunks is None else min(whole, max(chunks, 1))
    # The shipped corpus is documents of each kind one after the other: chunks spread over it.
    # A given text: its first chunks, as llama.cpp takes them.
    starts = [(i * whole // n if text is None else i) * ctx for i in range(n)]
    bos = tokenizer.bos_token_id if _adds_bos(tokenizer) else None
    first = ctx // 2
    for i, start in enumerate(starts):
        chunk = tokens[start : start + ctx]
        if bos is not None:
            chunk[0] = bos
        targets = mx.array(chunk[first + 1 :])  # (ctx - 1 - first,)
        ref_logp = None
        for k, m in enumerate(loaded):
            logp = m.score(chunk, first, targets, ref_logp, tokenizer.vocab_size)
            if k == 0 and reference is not None:
                ref_logp = logp
            del logp
        if log is not None:
            log(f"chunk {i + 1}/{n}: {(i + 1) * (ctx - 1 - first)} tokens scored")
    ref = loaded[0] if reference is not None else None
    return PerplexityReport(
        text_tokens=len(tokens),
        ctx=ctx,
        chunks=n,
        reference=ref.result(None) if ref is not None else None,
        models=[m.result(ref) for m in loaded[1 if ref is not None else 0 :]],
    )


class _Model:
    """A loaded model and what its scored tokens gave so far (one small array per chunk)."""

    def __init__(self, name: str, model_dir: Path, model, tokenizer):
        self.name, self.model_dir, self.model, self.tokenizer = name, model_dir, model, tokenizer
        self.nll, self.kld, self.same, self.p_diff, self.ref_nll = [], [], [], [], []

    @classmethod
    def open(cls, spec, log) -> _Model:
        return open_model(spec, lambda d: cls(str(spec), d, *load(d, log=log)), log=log)

    def score(self, chunk: list[int], first: int, targets: mx.array, ref_logp, vocab: int):
        """Log-probs of the scored positions of ``chunk`` (evaluated from scratch), recording
        this model's NLL and top tokens, and against ``ref_logp`` its KLD and Δp."""
        logits = self.model(mx.array(chunk)[None])[0, first:-1, :vocab]  # (ctx - 1 - first, V)
        logits = logits.astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll = -mx.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
        out = [nll]
        if ref_logp is not None:
            ref_nll = -mx.take_along_axis(ref_logp, targets[:, None], axis=-1)[:, 0]
            kld = (mx.exp(ref_logp) * (ref_logp - logp)).sum(axis=-1)
            same = mx.argmax(logp, axis=-1) == mx.argmax(ref_logp, axis=-1)
            out += [kld, same, mx.exp(-nll) - mx.exp(-ref_nll), ref_nll]
        # The one evaluation: the chunk's forward pass and its statistics together, so the
        # (ctx, V) logits are freed once the small per-token arrays exist.
        mx.eval(logp, *out)
        lists = [self.nll, self.kld, self.same, self.p_diff, self.ref_nll]
        for kept, a in zip(lists, out):
            kept.append(np.array(a).astype(np.float64))
        return logp

    def result(self, ref: _Model | None) -> Score:
        nll = np.concatenate(self.nll)
        mean, se = _mean_se(nll)
        size, params = weight_bytes_and_parameters(self.model_dir)
        ppl = math.exp(mean)
        score = Score(
            model=self.name,
            bytes=size,
            parameters=params,
            bits_per_weight=size * 8 / max(params, 1),
            tokens=len(nll),
            ppl=ppl,
            ppl_se=ppl * se,
        )
        if ref is None:
            return score
        kld = np.concatenate(self.kld)
        same = np.concatenate(self.same)
        p_diff = np.concatenate(self.p_diff)
        ref_nll = np.concatenate(self.ref_nll)
        score.delta_ppl_pct = (math.exp(mean - ref_nll.mean()) - 1) * 100
        score.kld, score.kld_se = _mean_se(kld)
        score.kld_median, score.kld_p90, score.kld_p99 = np.percentile(kld, [50, 90, 99]).tolist()
        score.kld_max = float(kld.max())
        p = same.mean()
        score.top1_pct = 100 * p
        score.top1_se_pct = 100 * math.sqrt(p * (1 - p) / (len(same) - 1)) if len(same) > 1 else 0
        score.rms_dp_pct = 100 * math.sqrt((p_diff**2).mean())
        return score


def weight_bytes_and_parameters(model_dir: Path) -> tuple[int, int]:
    """Bytes of the weight files ``model*.safetensors`` (headers included; a checkpoint whose
    files are named otherwise: all its safetensors files), and the parameter count of the
    model's unquantized shapes: every array of the float model its config.json builds (packed
    weights, scales and biases of a quantized layer are not counted, its full weight matrix is;
    a tied embedding counts once; norms and biases count)."""
    files = sorted(model_dir.glob("model*.safetensors")) or weight_files(model_dir)
    size = sum(f.stat().st_size for f in files)
    # Built lazily: the random initial values are never evaluated, so this allocates nothing.
    model = build_model(read_config(model_dir), str(model_dir / "config.json"))
    return size, sum(v.size for _, v in tree_flatten(model.parameters()))


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error, llama.cpp's way: sqrt((E[x²] - E[x]²) / (n - 1))."""
    mean = float(x.mean())
    var = float((x * x).mean()) - mean * mean
    return mean, math.sqrt(var / (len(x) - 1)) if len(x) > 1 and var > 0 else 0.0


def _adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer.encode("a")[:1] == [bos]


def _check_vocabulary(tokenizer, other: _Model) -> None:
    """Raise :class:`QualityError` unless ``other``'s tokenizer maps every id as ``tokenizer``."""
    t, o = tokenizer, other.tokenizer
    if t is o:
        return
    why = None
    if t.vocab_size != o.vocab_size:
        why = f"{o.vocab_size} tokens vs {t.vocab_size}"
    else:
        for i in range(t.vocab_size):
            if (a := o.id_to_token(i)) != (b := t.id_to_token(i)):
                why = f"token {i} is {a!r}, not {b!r}"
                break
    if why is not None:
        raise QualityError(
            f"{other.name}: another vocabulary than the first model's ({why}); "
            "perplexity compares models on the same tokens"
        )
