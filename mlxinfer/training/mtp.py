"""``mlxinfer train-mtp``: give a model that ships no multi-token-prediction head one of its own.

Self-distillation, in MLX, on the machine at hand (``docs/speculative.md``, trained heads):

1. **Text the model writes itself.** The shipped prompts (``prompts.txt``, or the caller's) go
   through the model's chat template and ``stream_generate``, each answered twice: greedy and
   sampled (temperature 0.8, seeded), so the head sees the model's own distribution where it
   will draft.
2. **The trunk once.** Each sequence's final-norm states ``h`` are computed once and kept; the
   trunk is frozen throughout.
3. **One DeepSeek-layout head** (``models/layers/mtp.py``: ``[enorm(e), hnorm(h)] → eh_proj →``
   the family's own block ``→ shared_head.norm →`` the trunk's LM head), its block started from
   the trunk's last block (dequantized) with its residual branches' output projections at zero
   and ``eh_proj`` at ``[0, I]`` (it begins as the identity on the hidden state), trained with AdamW to match, at every pair ``(h_j, x_{j+1})``, the trunk's own
   next-token distribution at ``j + 1``: the KL divergence ``KL(p_trunk(x_{j+2}) || p_head)``
   over the trunk's 32 likeliest tokens (``top_k``; computed once; the rest of its mass is left out). That
   is the distribution speculative decoding accepts against, at any temperature. **Chained as it
   drafts:** a draft k > 1 feeds the head its own output ``g_j`` with the next token, so the head
   is also trained on the pairs ``(g_j, x_{j+2})`` against the trunk's distribution for
   ``x_{j+3}`` (the same KL, weighted by ``chain_weight``; gradients through both applications),
   the chained pairs attending to one another causally (at drafting time they attend to the
   verified pairs before them: an approximation, as in the heads' own training).
4. **Saved** beside the model (``mtp_head.safetensors`` in its directory, where ``MTP()`` finds
   it) or where ``output`` says, with metadata naming the model it fits; a held-out eighth of
   the prompts (both their answers) measures how often the head's top token is the trunk's (``top1``: the greedy
   acceptance of the first draft, predicted).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from ..errors import DraftError
from ..models.layers.mtp import (
    DEEPSEEK,
    HEAD_FILE,
    MTPHead,
    head_metadata,
    new_head_block,
    save_head,
)
from .mtp_data import generate_sequences, pairs, shipped_prompts, teacher


@dataclass
class TrainReport:
    """What a training run did and reached (``train-mtp`` prints it; tools/bench_mtp.py keeps
    it): held-out KL and top-1 agreement before and after, and where the head went."""

    path: Path
    sequences: int
    tokens: int
    steps: int
    generate_s: float
    train_s: float
    kl_before: float
    kl_after: float
    top1_before: float
    top1_after: float
    losses: list[float] = field(default_factory=list)
    # The chained step (the head fed its own output; the second draft), held out likewise:
    # KL against the trunk's distribution two tokens on, and its top-1 agreement.
    kl_chained_before: float = float("nan")
    kl_chained_after: float = float("nan")
    top1_chained_before: float = float("nan")
    top1_chained_after: float = float("nan")


def _start_from_trunk(block: nn.Module, trunk_block: nn.Module, final_norm: nn.Module) -> None:
    """The head's block begins as the trunk's last (quantized layers dequantized) with its
    ``o_proj`` and ``down_proj`` at zero, its output norm as the trunk's final norm, and
    ``eh_proj`` as ``[0, I]``: at step 0 the head passes the final states through."""
    source = dict(tree_flatten(trunk_block.parameters()))
    modules = dict(trunk_block.named_modules())
    new = []
    for name, p in tree_flatten(block.parameters()):
        owner, _, leaf = name.rpartition(".")
        m = modules.get(owner)
        if leaf == "weight" and m is not None:
            w = _float_weight(m)
        else:
            w = source.get(name)
        if w is not None and tuple(w.shape) == tuple(p.shape):
            new.append((name, w.astype(mx.float32)))
    hidden = block.eh_proj.weight.shape[0]
    eye = mx.concatenate([mx.zeros((hidden, hidden)), mx.eye(hidden)], axis=1)
    new.append(("eh_proj.weight", eye))
    # The residual branches' last projections start at zero: the block starts as the identity
    # (the head then repeats the trunk's own next-token distribution, a fair first guess for the
    # one after), and the rest of the trunk's block is there to learn from.
    for name, p in tree_flatten(block.parameters()):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            new.append((name, mx.zeros(p.shape)))
    norm_w = getattr(final_norm, "weight", None)
    if norm_w is not None:
        new.append(("shared_head.norm.weight", norm_w.astype(mx.float32)))
    block.load_weights(list(dict(new).items()), strict=False)  # later entries win


def _float_weight(m: nn.Module) -> mx.array:
    """A Linear's or Embedding's weight as float32 (a quantized one dequantized)."""
    if not hasattr(m, "scales"):
        return m.weight.astype(mx.float32)
    w = mx.dequantize(
        m.weight,
        m.scales,
        getattr(m, "biases", None),
        group_size=m.group_size,
        bits=m.bits,
        mode=getattr(m, "mode", "affine"),
    )
    return w.astype(mx.float32)


def _dense_head(model) -> mx.array:
    """The LM head's weight (V, H) as float32 (a quantized head dequantized)."""
    w = _float_weight(model.head)
    mx.eval(w)
    return w


def train_mtp(
    model,
    tokenizer,
    *,
    output: str | Path | None = None,
    prompts: Sequence[str] | None = None,
    max_tokens: int = 192,
    steps: int = 300,
    batch_size: int = 8,
    learning_rate: float = 1e-4,
    top_k: int = 32,
    draft_vocab: int = 8192,
    chain_weight: float = 1.0,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> TrainReport:
    """Train one MTP head for ``model`` (see the module's text) and save it; returns the
    :class:`TrainReport`. ``output``: the head's file (default: ``mtp_head.safetensors`` in the
    model's directory). ``prompts``: instead of the shipped ones (at least two: an eighth, or
    one, is held out). ``max_tokens``: each completion's length; ``steps``, ``batch_size``,
    ``learning_rate``: the optimiser's (AdamW, cosine decay, 5 % warm-up). ``top_k``: the trunk's
    likeliest tokens the KL is taken over. ``draft_vocab``: the head drafts over at most this
    many tokens, those the model wrote most in the training answers (0: the whole vocabulary).
    ``chain_weight``: the chained step's share of the loss (0: the first draft's alone)."""
    say = log or (lambda _m: None)
    if not math.isfinite(learning_rate) or learning_rate <= 0:
        raise DraftError(
            f"train-mtp: learning rate must be a positive number, found {learning_rate}"
        )
    if not math.isfinite(chain_weight) or chain_weight < 0:
        raise DraftError(f"train-mtp: chain weight must be a number >= 0, found {chain_weight}")
    for name, value, low in (
        ("steps", steps, 1),
        ("batch_size", batch_size, 1),
        ("top_k", top_k, 1),
    ):
        if value < low:
            raise DraftError(f"train-mtp: {name} must be at least {low}, found {value}")
    if getattr(model, "mtp_heads", None):
        raise DraftError("this model already has MTP heads (shipped or attached); nothing to train")
    if output is None:
        source = getattr(model, "source_dir", None)
        if source is None:
            raise DraftError("train-mtp: the model has no directory to save beside; give output")
        output = Path(source) / HEAD_FILE
    output = Path(output)
    prompts = list(prompts) if prompts is not None else shipped_prompts()
    if len(prompts) < 2:
        raise DraftError(
            f"train-mtp: needs at least 2 prompts (one is held out), found {len(prompts)}"
        )
    block = new_head_block(model)  # DraftError for a family it does not fit
    _start_from_trunk(block, model.layers[-1], model[model.inner_name].norm)
    block.set_dtype(mx.float32)
    mx.eval(block.parameters())

    t0 = time.perf_counter()
    seqs = generate_sequences(model, tokenizer, prompts, max_tokens=max_tokens, seed=seed)
    generate_s = time.perf_counter() - t0
    inner = model[model.inner_name]
    states = []
    for s in seqs:
        h = inner(mx.array(s)[None]).astype(mx.float32)[0]  # (L, H) after the final norm
        mx.eval(h)
        states.append(h)
    n_tokens = sum(len(s) for s in seqs)
    say(f"train-mtp: {len(seqs)} sequences, {n_tokens} tokens written in {generate_s:.1f} s")

    held = max(1, len(prompts) // 8)  # prompts held out, with both their answers
    mx.random.seed(seed)
    perm = mx.random.permutation(len(prompts)).tolist()
    test_rows = [2 * i + j for i in perm[:held] for j in (0, 1)]
    train_rows = [2 * i + j for i in perm[held:] for j in (0, 1)]
    vocab = None  # the token ids the head drafts over (None: all), most written first
    n_vocab = model.args.vocab_size
    if draft_vocab:
        counts: dict[int, int] = {}
        for r in train_rows:
            for t in seqs[r]:
                counts[t] = counts.get(t, 0) + 1
        ranked = sorted(counts, key=lambda t: (-counts[t], t))[:draft_vocab]
        if len(ranked) < n_vocab:
            vocab = mx.array(ranked, dtype=mx.int32)
            inside = set(ranked)
            held_tokens = [t for r in test_rows for t in seqs[r]]
            covered = sum(t in inside for t in held_tokens) / max(1, len(held_tokens))
            say(
                f"train-mtp: drafts over the {len(ranked)} tokens the model wrote most; they "
                f"cover {covered:.1%} of the held-out text"
            )
    lm_w = _dense_head(model)  # (V, H) float32: BLAS, not a quantized matmul, for the batch
    teachers = [teacher(h, lm_w, top_k) for h in states]  # over the whole vocabulary
    # The head is trained as it drafts: its softmax over the draft vocabulary alone (cheaper
    # by the same factor); the trunk's likeliest tokens outside it count for nothing.
    if vocab is not None:
        lm_w = lm_w[vocab]
        where = mx.full((n_vocab,), -1, dtype=mx.int32)
        where[vocab] = mx.arange(vocab.size, dtype=mx.int32)
        teachers = [(tv, where[ti]) for tv, ti in teachers]
    mx.eval(lm_w, teachers)
    head = MTPHead(block, DEEPSEEK, inner.embed_tokens, lambda g: g @ lm_w.T)
    length = max(len(s) for s in seqs)

    def kl_and_top1(g, tv, ti, mask):
        logp = nn.log_softmax(head.logits(g.astype(mx.float32)), axis=-1)
        # KL(trunk || head) over the trunk's likeliest tokens (its mass beyond them, and on
        # tokens outside the draft vocabulary, ti = -1, is left out)
        valid = ti >= 0
        student = mx.take_along_axis(logp, mx.maximum(ti, 0), axis=-1)
        kl = mx.where(valid, mx.exp(tv) * (tv - student), 0.0).sum(-1)
        denom = mx.maximum(mask.sum(), 1.0)
        agree = (logp.argmax(-1) == ti[..., 0]).astype(mx.float32)
        return (kl * mask).sum() / denom, (agree * mask).sum() / denom

    def scores(tokens, h, tv, ti, mask):
        """(KL, top-1) of the first draft's pairs (h_j, x_{j+1}) and of the chained ones
        (g_j, x_{j+2}) against the trunk's distribution for x_{j+3} (pair j + 1's teacher)."""
        g = head(tokens, h, None)
        first = kl_and_top1(g, tv, ti, mask)
        if tokens.shape[1] < 2:
            return first, (mx.array(0.0), mx.array(0.0))
        g2 = head(tokens[:, 1:], g[:, :-1], None)
        return first, kl_and_top1(g2, tv[:, 1:], ti[:, 1:], mask[:, 1:])

    def loss_fn(tokens, h, tv, ti, mask):
        if chain_weight == 0:
            return kl_and_top1(head(tokens, h, None), tv, ti, mask)[0]
        (kl1, _), (kl2, _) = scores(tokens, h, tv, ti, mask)
        return kl1 + chain_weight * kl2

    def held_out() -> tuple[float, float, float, float]:
        """Held-out (KL, top-1, chained KL, chained top-1), each the mean over the rows."""
        total = [0.0, 0.0, 0.0, 0.0]
        for i in range(0, len(test_rows), batch_size):
            rows = test_rows[i : i + batch_size]
            (a, b), (c, d) = scores(*pairs(seqs, states, teachers, rows, length))
            mx.eval(a, b, c, d)
            for j, v in enumerate((a, b, c, d)):
                total[j] += v.item() * len(rows)
        return tuple(t / len(test_rows) for t in total)  # type: ignore[return-value]

    kl_before, top1_before, kl2_before, top1_2_before = held_out()
    say(
        f"train-mtp: held out {held} prompts: KL {kl_before:.3f}, top-1 {top1_before:.1%}; "
        f"chained: KL {kl2_before:.3f}, top-1 {top1_2_before:.1%}"
    )
    warm = max(1, steps // 20)
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(learning_rate / 10, learning_rate, warm),
            optim.cosine_decay(learning_rate, max(1, steps - warm), learning_rate / 20),
        ],
        [warm],
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
    grad = nn.value_and_grad(block, loss_fn)  # the head's block only: the trunk stays frozen
    block.train()
    losses = []
    t1 = time.perf_counter()
    for step in range(steps):
        idx = mx.random.randint(0, len(train_rows), (batch_size,)).tolist()
        rows = [train_rows[i] for i in idx]
        loss, grads = grad(*pairs(seqs, states, teachers, rows, length))
        opt.update(block, grads)
        mx.eval(loss, block.parameters(), opt.state)
        value = loss.item()
        if not math.isfinite(value):
            raise DraftError(
                f"train-mtp: the loss diverged at step {step + 1} ({value}); try a lower learning rate"
            )
        losses.append(value)
        if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
            recent = losses[-max(1, steps // 10) :]
            say(f"train-mtp: step {step + 1}/{steps}: loss {sum(recent) / len(recent):.3f}")
    block.eval()
    train_s = time.perf_counter() - t1
    kl_after, top1_after, kl2_after, top1_2_after = held_out()
    say(
        f"train-mtp: held out: KL {kl_after:.3f}, top-1 {top1_after:.1%} (from "
        f"{top1_before:.1%}); chained: KL {kl2_after:.3f}, top-1 {top1_2_after:.1%} (from "
        f"{top1_2_before:.1%})"
    )

    dtype = model[model.inner_name].norm.weight.dtype
    block.set_dtype(dtype if mx.issubdtype(dtype, mx.floating) else mx.float32)
    meta = head_metadata(model)
    meta.update(
        steps=str(steps),
        sequences=str(len(seqs)),
        tokens=str(n_tokens),
        held_out_kl=f"{kl_after:.4f}",
        held_out_top1=f"{top1_after:.4f}",
        held_out_top1_chained=f"{top1_2_after:.4f}",
        chain_weight=f"{chain_weight:g}",
    )
    save_head(block, output, meta, vocab)
    say(f"train-mtp: saved {output}")
    return TrainReport(
        output,
        len(seqs),
        n_tokens,
        steps,
        generate_s,
        train_s,
        kl_before,
        kl_after,
        top1_before,
        top1_after,
        losses,
        kl2_before,
        kl2_after,
        top1_2_before,
        top1_2_after,
    )
