"""Multi-token prediction (MTP) heads: one generic layer over a family's own decoder block.

What the reference computes (transformers 5.25: ``modeling_layers.MtpLayer`` / ``MtpModel``,
``generation.candidate_generator.MTPCandidateGenerator``, ``cache_utils.MtpCache``; read in
site-packages, and vLLM's / mlx-lm #990's MiMo and DeepSeek heads for the weight names):

- Families: ``generate(use_mtp=True)`` runs for configs with ``num_mtp_layers`` (DeepSeek-V3,
  GLM-4.5 MoE, Ernie 4.5 MoE, Mellum, …; ``num_nextn_predict_layers`` in config.json). MiMo
  (``model_type: mimo``) has no transformers model; its head is MtpLayer with
  ``mtp_hidden_states_first=True`` over a Qwen2 block, which is how the tests check ours.
- One head step, for the pair (h_j, x_{j+1}): h_j the trunk's last hidden state at position j
  AFTER its final norm (``hidden_states[-1]``), x_{j+1} the token that followed::

      e = embed(x_{j+1});  u = eh_proj(concat([enorm(e), hnorm(h_j)]))   # DeepSeek/GLM order
                           u = eh_proj(concat([hnorm(h_j), enorm(e)]))   # MiMo: hidden first
      g = post_norm(block(u))            # the family's decoder block, its own KV cache
      logits = lm_head(g)                # the trunk's head (shared), predicts x_{j+2}

- Weight names: DeepSeek/GLM keep the head as decoder layer N (``model.layers.N.{enorm, hnorm,
  eh_proj, shared_head.norm}`` + the block's own, always MoE); MiMo as ``model.mtp_layers.i.
  {token_layernorm, hidden_layernorm, input_proj, final_layernorm}`` + a Qwen2 block's;
  Qwen3-Next/3.5 as ``mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm, layers.0.*}``
  ([e, h], (1 + w) norms: OffsetRMSNorm, whose stored weight is the offset, never shifted in
  sanitize, so it cannot be shifted twice). Each family's ``sanitize`` moves its heads to
  ``model.mtp_layers.i.*``, where the model holds them (a converted checkpoint keeps that name).
- Positions and cache: the head's cache gets one entry per pair, primed over the whole prompt
  (pair 0 is (h_0, x_1): position 0 has no pair, so nothing there needs masking). transformers
  ropes pair j at position j+1; here pair j sits at cache offset j. RoPE scores depend only on
  position differences, so the two agree (the parity test checks it).
- Chained drafts: with one head and k > 1, the next step's pair is (g, d): the head's own
  post-norm output and the token it drafted (transformers chains layer i+1 on layer i's output
  the same way; vLLM and mlx-lm recycle one head). Chained entries are dropped from the head's
  cache after drafting: only real pairs (a trunk hidden state) stay.

A family keeps its heads by adding its blocks, extended by :func:`extend_block`, to its inner
model as ``mtp_layers`` and mixing :class:`MTPHeads` into its model: ``model.mtp_heads`` (the
:class:`MTPHead` objects) and ``model.trunk(inputs, cache) -> (hidden, logits)``. Heads are
found by their weights (:func:`keep_present_heads`): a config announcing heads whose weights
were stripped still loads, without heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from ...cache.kv import Cache, KVCache
from .norms import RMSNorm


@dataclasses.dataclass(frozen=True)
class MTPSpec:
    """How one family writes its heads: the checkpoint's names and the head's conventions.

    ``enorm``, ``hnorm``, ``proj``, ``post_norm``: names, inside the block, of the embedding's
    norm, the hidden state's norm, the 2H -> H projection and the output norm (dotted: a
    submodule, DeepSeek's ``shared_head.norm``). ``hidden_first``: concat [h, e] (MiMo) instead
    of [e, h]. ``norm``: the norm class (RMSNorm; OffsetRMSNorm for Qwen's (1 + w)).
    """

    enorm: str
    hnorm: str
    proj: str
    post_norm: str
    hidden_first: bool = False
    norm: Callable[..., nn.Module] = RMSNorm


MIMO = MTPSpec("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm", True)
DEEPSEEK = MTPSpec("enorm", "hnorm", "eh_proj", "shared_head.norm")


def extend_block(block: nn.Module, spec: MTPSpec, hidden: int, eps: float) -> nn.Module:
    """``block`` (a family's decoder block) with the head's norms and projection added under
    the checkpoint's names, so the head's weights load where the checkpoint has them."""
    for name in (spec.enorm, spec.hnorm, spec.post_norm):
        _set(block, name, spec.norm(hidden, eps=eps))
    _set(block, spec.proj, nn.Linear(2 * hidden, hidden, bias=False))
    return block


def _set(module: nn.Module, dotted: str, value: nn.Module) -> None:
    *parents, last = dotted.split(".")
    for name in parents:
        if name not in module:
            module[name] = nn.Module()
        module = module[name]
    module[last] = value


def _get(module: nn.Module, dotted: str) -> nn.Module:
    for name in dotted.split("."):
        module = module[name]
    return module


class MTPHead:
    """One head of a model: a block made by :func:`extend_block`, run as the reference does.

    ``embed``: token ids -> embeddings (the trunk's); ``logits``: hidden -> logits (the trunk's
    LM head); ``make_cache``: the block's cache (a KVCache for attention blocks).
    """

    def __init__(
        self,
        block: nn.Module,
        spec: MTPSpec,
        embed: Callable[[mx.array], mx.array],
        logits: Callable[[mx.array], mx.array],
        make_cache: Callable[[], Cache] = KVCache,
    ):
        self.block, self.spec, self.embed, self.logits = block, spec, embed, logits
        self.make_cache = make_cache

    def __call__(self, tokens: mx.array, hidden: mx.array, cache: Cache | None) -> mx.array:
        """The head's post-norm output g (B, L, H) for the pairs (hidden[:, i], tokens[:, i]).

        ``tokens`` (B, L): x_{j+1}; ``hidden`` (B, L, H): h_j, post-final-norm (or a chained g).
        """
        b, s = self.block, self.spec
        e = _get(b, s.enorm)(self.embed(tokens))  # (B, L, H)
        h = _get(b, s.hnorm)(hidden)  # (B, L, H)
        u = _get(b, s.proj)(mx.concatenate([h, e] if s.hidden_first else [e, h], axis=-1))
        L = u.shape[1]
        mask = cache.make_mask(L) if cache is not None else ("causal" if L > 1 else None)
        return _get(b, s.post_norm)(b(u, mask, cache))


class MTPHeads:
    """What a family with heads adds to its ``models.base.CausalLM`` (a mixin): the trunk's
    states beside its logits, the heads as :class:`MTPHead` objects, and the loader's hook.
    The inner model holds the heads' blocks in ``mtp_layers``; ``mtp_spec`` says how to read
    them."""

    mtp_spec: MTPSpec
    inner_name: str  # the CausalLM's (annotations only: the model class defines them)
    head: nn.Module

    def trunk(self, inputs: mx.array, cache=None) -> tuple[mx.array, mx.array]:
        """(hidden (B, L, H) after the final norm, logits (B, L, V)): what an MTP head reads."""
        h = self._inner(inputs, cache)
        return h, self._logits(h)

    @property
    def _inner(self):
        return getattr(self, self.inner_name)

    def _logits(self, h: mx.array) -> mx.array:
        head = self.head  # the embedding (tied) or a Linear, as models.base.lm_head
        if isinstance(head, (nn.Embedding, nn.QuantizedEmbedding)):
            return head.as_linear(h)
        return head(h)

    def mtp_cache(self) -> Cache:
        """A head's cache: a KVCache (a family whose block needs another overrides this)."""
        return KVCache()

    @property
    def mtp_heads(self) -> list[MTPHead]:
        """The MTP heads the checkpoint has (none when its MTP weights were stripped)."""
        inner = self._inner
        shipped = [
            MTPHead(b, self.mtp_spec, inner.embed_tokens, self._logits, self.mtp_cache)
            for b in inner.mtp_layers
        ]  # else one trained here, if attached (attach_head)
        return shipped or list(self.__dict__.get("attached_mtp_heads", ()))

    def drop_absent_heads(self, weights) -> None:
        """Keep only the heads ``weights`` has (the loader calls it before loading)."""
        prefix = f"{self.inner_name}.mtp_layers."
        keep_present_heads(self._inner, "mtp_layers", prefix, weights)


# A DeepSeek-layout MTP layer's own copies of the trunk's embedding and LM head (DeepSeek-V3's
# checkpoints carry them; transformers' MtpModel ignores them too): the trunk's serve.
_SHARED_WITH_TRUNK = ("embed_tokens.", "shared_head.head.")


def nextn_layers_as_heads(weights: dict, n_layers: int, heads: int) -> dict:
    """DeepSeek's layout (decoder layers ``model.layers.N+i.*`` after the trunk's N) moved to
    ``model.mtp_layers.i.*``, where the model keeps its heads' blocks: the ``heads`` layers the
    config announces, without their copies of the embedding and LM head; any later layer goes.
    Names already moved (a converted checkpoint) pass through."""
    out = {}
    for key, value in weights.items():
        parts = key.split(".")
        if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit():
            i = int(parts[2]) - n_layers
            if i >= 0:
                rest = ".".join(parts[3:])
                if i < heads and not rest.startswith(_SHARED_WITH_TRUNK):
                    out[f"{parts[0]}.mtp_layers.{i}.{rest}"] = value
                continue
        out[key] = value
    return out


def keep_present_heads(inner: nn.Module, attr: str, prefix: str, weights) -> None:
    """Drop ``inner.<attr>``'s heads whose weights ``weights`` lacks (a checkpoint whose config
    announces heads but whose MTP weights were stripped, as many conversions do). Head i is
    present when some weight starts with ``f"{prefix}{i}."``; the heads kept are the leading
    ones that are present."""
    heads = inner[attr]
    n = 0
    while n < len(heads) and any(k.startswith(f"{prefix}{n}.") for k in weights):
        n += 1
    inner[attr] = heads[:n]


# --- Heads trained here (``mlxinfer train-mtp``) for a model that ships none ----------------
#
# One DeepSeek-layout head over the family's own decoder block: ``[enorm(e), hnorm(h)]`` →
# ``eh_proj`` → block → ``shared_head.norm`` → the trunk's LM head. It is saved as one
# safetensors file (``mtp_layers.0.*`` + metadata naming the model it was trained for) beside
# the model (``HEAD_FILE`` in its directory) or where ``-o`` says; ``MTP()`` attaches it.

HEAD_FILE = "mtp_head.safetensors"
HEAD_FORMAT = "mlxinfer-mtp-head"
_HEAD_PREFIX = "mtp_layers.0."


def new_head_block(model) -> nn.Module:
    """A fresh block of ``model``'s own family, extended into a DeepSeek-layout head. Raises
    :class:`~mlxinfer.errors.DraftError` for a family a trained head cannot be given: one whose
    logits are not its LM head over its inner model's states, or whose blocks are not one
    class (``Inner.Block``)."""
    from ...errors import DraftError
    from ..base import CausalLM

    family = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    inner = model[model.inner_name] if isinstance(model, CausalLM) else None
    block_cls = getattr(type(inner), "Block", None)
    if inner is None or block_cls is None or type(model).__call__ is not CausalLM.__call__:
        raise DraftError(
            f"model family {family!r}: a trained MTP head needs a decoder whose blocks are one "
            "class and whose logits are its LM head over the final norm (llama, qwen2, qwen3, "
            "mistral, …)"
        )
    args = model.args
    try:
        block = block_cls(args, len(model.layers) - 1)  # (args, layer index): qwen2-style
    except TypeError:
        block = block_cls(args)
    hidden = _hidden_size(model)
    eps = getattr(args, "rms_norm_eps", 1e-6)
    return extend_block(block, DEEPSEEK, hidden, eps)


def attach_head(model, path) -> None:
    """Give ``model`` (a family without shipped heads) the head trained for it in ``path``.
    Raises :class:`~mlxinfer.errors.DraftError` naming the file and what does not match."""
    from pathlib import Path

    from ...errors import DraftError, WeightsError
    from ...files.safetensors_check import check_safetensors

    path = Path(path)
    try:
        check_safetensors(path)  # before MLX maps it: a truncated or hostile header is ours
        loaded, found = mx.load(str(path), return_metadata=True)
    except WeightsError as e:
        raise DraftError(f"not an MTP head file: {e}") from None
    except Exception as e:  # a missing, truncated or foreign file
        raise DraftError(f"{path}: not an MTP head file ({type(e).__name__}: {e})") from None
    weights = cast("dict[str, mx.array]", loaded)
    meta = cast("dict[str, str]", found)
    if meta.get("format") != HEAD_FORMAT:
        raise DraftError(
            f"{path}: metadata 'format' must be {HEAD_FORMAT!r}, found {meta.get('format')!r}"
        )
    for key, want in head_metadata(model).items():
        if meta.get(key) != want:
            raise DraftError(
                f"{path}: trained for another model: metadata {key!r} is {meta.get(key)!r}, "
                f"this model's is {want!r}"
            )
    block = new_head_block(model)
    vocab = weights.pop(DRAFT_VOCAB, None)
    if vocab is not None:
        n = model.args.vocab_size
        if vocab.ndim != 1 or not mx.issubdtype(vocab.dtype, mx.integer) or vocab.size == 0:
            raise DraftError(f"{path}: {DRAFT_VOCAB!r} must be a 1-D list of token ids")
        if int(vocab.min()) < 0 or int(vocab.max()) >= n:
            raise DraftError(f"{path}: {DRAFT_VOCAB!r} has ids outside 0..{n - 1}")
    if not all(k.startswith(_HEAD_PREFIX) for k in weights):
        bad = next(k for k in weights if not k.startswith(_HEAD_PREFIX))
        raise DraftError(f"{path}: weight {bad!r} is not under {_HEAD_PREFIX!r}")
    try:
        block.load_weights([(k[len(_HEAD_PREFIX) :], v) for k, v in weights.items()])
    except ValueError as e:
        raise DraftError(f"{path}: the head's weights do not fit this model's block: {e}") from None
    mx.eval(block.parameters())
    block.eval()
    inner = model[model.inner_name]
    logits = model.head_logits if vocab is None else draft_vocab_logits(model, vocab)
    head = MTPHead(block, DEEPSEEK, inner.embed_tokens, logits)
    object.__setattr__(model, "attached_mtp_heads", (head,))
    object.__setattr__(model, "attached_mtp_head_path", path)


# A trained head drafts over the tokens the model writes most (its file's ``draft_vocab``: ids,
# most frequent first), not the whole vocabulary: the LM head's rows for them alone, so a draft
# costs a fraction of the trunk's LM head (FR-Spec, Zhao et al. 2025). Exactness is untouched:
# the draft's distribution is zero outside them, and the rejection rule takes any distribution.
DRAFT_VOCAB = "draft_vocab"


def draft_vocab_logits(model, ids: mx.array) -> Callable[[mx.array], mx.array]:
    """The LM head over final-norm states restricted to the token ids ``ids``: logits (…, V)
    with -inf outside them (only ``len(ids)`` rows of the head are read)."""
    head, n = model.head, model.args.vocab_size
    ids = ids.astype(mx.int32)
    if hasattr(head, "scales"):  # quantized (an embedding or a Linear): the rows, still packed
        rows = [head.weight[ids], head.scales[ids]]
        biases = getattr(head, "biases", None)
        kw = {"group_size": head.group_size, "bits": head.bits}
        if getattr(head, "mode", "affine") != "affine":
            kw["mode"] = head.mode
        b = biases[ids] if biases is not None else None
        mx.eval(rows, b if b is not None else [])

        def sub(g):
            return mx.quantized_matmul(g, rows[0], rows[1], b, transpose=True, **kw)
    else:
        w = head.weight[ids]
        mx.eval(w)

        def sub(g):
            return g @ w.T

    def logits(g: mx.array) -> mx.array:
        part = sub(g)  # (…, len(ids))
        full = mx.full((*part.shape[:-1], n), -mx.inf, dtype=part.dtype)
        full[..., ids] = part
        return full

    return logits


def save_head(
    block: nn.Module, path, metadata: dict[str, str], draft_vocab: mx.array | None = None
) -> None:
    """Write a trained head's weights, ``metadata`` and ``draft_vocab`` (token ids the head
    drafts over; None: all) to ``path`` (temporary file, fsync, rename)."""
    from pathlib import Path

    from mlx.utils import tree_flatten

    from ...files.atomic import writing_file

    params = cast("list[tuple[str, mx.array]]", tree_flatten(block.parameters()))
    weights = {_HEAD_PREFIX + k: v for k, v in params}
    if draft_vocab is not None:
        weights[DRAFT_VOCAB] = draft_vocab.astype(mx.int32)
    with writing_file(Path(path)) as tmp:
        mx.save_safetensors(str(tmp), weights, metadata={"format": HEAD_FORMAT, **metadata})


def head_metadata(model) -> dict[str, str]:
    """What :func:`attach_head` checks a head file against."""
    return {
        "model_type": str(model.args.model_type),
        "hidden_size": str(_hidden_size(model)),
        "vocab_size": str(model.args.vocab_size),
        "num_hidden_layers": str(len(model.layers)),
    }


def _hidden_size(model) -> int:
    """The model's hidden size (its config's; a quantized embedding's weight is packed)."""
    return int(getattr(model.args, "hidden_size", 0) or model.embedding.weight.shape[-1])
