"""Draft sources for speculative decoding: a second model, prompt lookup, self-drafting.

A draft source (:class:`DraftModel`, :class:`PromptLookup`, :class:`SelfDraft`)
holds request-independent settings; ``start`` makes the per-request
:class:`Drafter` that proposes tokens for ``speculative_generate_step`` to verify.

- ``DraftModel``: a second, cheaper model with the same vocabulary and its own cache.
- ``PromptLookup``: no model. Finds the latest earlier occurrence of the last few
  tokens in the prompt and the text so far and proposes what followed it
  (pays off when the output copies the input: edits, rewrites, extraction).
- ``SelfDraft``: the target's own first N blocks, then its final norm and LM
  head. No second model: the weights are the target's, and so are the KV
  caches of those N layers (drafted entries are dropped and the verification
  pass writes them again).
- ``MTP`` (``mtp_drafts.py``): the multi-token-prediction
  head the checkpoint ships or ``train-mtp`` trained (``models/layers/mtp.py``). It
  reads the trunk's final hidden states, which the runner hands it (``observe``) from
  the prompt's prefill and from each verification pass, and keeps its own small KV cache.
"""

from __future__ import annotations

import copy
from typing import Callable, Protocol, cast

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import LayerCache, is_trimmable, restore_cache, snapshot_cache
from ..cache.prompt import PromptCache, Snapshot
from ..cache.rotating import RotatingKVCache
from ..errors import DraftError
from .prefill import prefill, rewind

# (1, V) draft logits -> (token (1,) int32, log-probs it was drawn from (1, V), or None when greedy)
DraftSampler = Callable[[mx.array], tuple[mx.array, "mx.array | None"]]

_NO_TOKENS = mx.array([], dtype=mx.int32)


class Drafter(Protocol):
    """One request's drafting state."""

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[mx.array, mx.array | None]:
        """Up to ``k`` tokens to follow ``history`` (whose last token is in no cache yet).

        Returns the tokens (m,) int32 and the (m, V) log-probs each was drawn
        from, or None for a deterministic draft (a point mass on each token).
        Draft models call ``sample`` once per token: it applies the request's
        logits processors and sampling settings, exactly as for the target.
        """
        ...

    def rewind(self, kept: list[int]) -> None:
        """The target's cache now holds ``kept``: keep only a prefix of it in the draft's cache."""
        ...


class Observer(Protocol):
    """A drafter that reads the target's final hidden states (an MTP head's): the runner
    prefills and verifies with ``model.trunk`` and hands it those of every token it keeps."""

    def observe(self, hidden: mx.array, following: list[int]) -> list[mx.array]:
        """``hidden`` (L, H): the target's states at L consecutive kept positions;
        ``following``: the L tokens that follow them. Returns arrays for the caller's
        ``mx.eval`` (the drafter's cache writes), so a prefill chunk's graph ends there."""
        ...


class Draft:
    """Base of the draft sources."""

    def check(self, model, tokenizer) -> None:
        """Raise :class:`DraftError` if this draft cannot serve ``model`` with ``tokenizer``."""

    def start(self, model, cache: list[LayerCache], prompt: list[int]) -> Drafter:
        """Begin a request: ``cache`` is the target's, about to hold all of ``prompt`` but its
        last token (the runner prefills it right after, telling an :class:`Observer`)."""
        raise NotImplementedError


# --- A second model ------------------------------------------------------------------------------


class DraftModel(Draft):
    """Draft with a second model that shares the target's vocabulary.

    Args:
        model: the draft model (several times cheaper than the target to pay off).
        tokenizer: its tokenizer; when given, ``stream_generate`` checks that it
            equals the target's, token by token.
        prompt_cache: reuse the draft's cache across requests (chat turns), like
            the target's ``prompt_cache``; one request at a time.
    """

    def __init__(self, model, tokenizer=None, *, prompt_cache: PromptCache | None = None):
        self.model, self.tokenizer, self.prompt_cache = model, tokenizer, prompt_cache

    def check(self, model, tokenizer) -> None:
        if self.tokenizer is not None and tokenizer is not None:
            check_vocabulary(tokenizer, self.tokenizer)

    def start(self, model, cache: list[LayerCache], prompt: list[int]) -> Drafter:
        drafter = self.drafter(model, self.prompt_cache)
        todo = drafter.pc.reuse(prompt)
        prefill(self.model, drafter.pc, todo[:-1])
        return drafter

    def drafter(self, model, pc: PromptCache | None = None) -> _ModelDrafter:
        """A drafter for target ``model`` over ``pc`` (a fresh cache when None) that has read
        nothing new: the batching engine feeds each request's prompt to it (``feed``)."""
        pc = pc if pc is not None else PromptCache(self.model.make_cache())
        if any(isinstance(c, RotatingKVCache) for c in pc.cache):
            raise DraftError(
                f"draft model {_name(self.tokenizer)}: its rotating (sliding-window) KV cache "
                "cannot be rewound; speculative decoding needs one that can"
            )
        return _ModelDrafter(self.model, pc, width=model.args.vocab_size)


class _ModelDrafter:
    """Drafts k tokens with a model that keeps its own cache (``pc.tokens`` ⊑ history)."""

    def __init__(self, model, pc: PromptCache, width: int):
        self.model, self.pc, self.width = model, pc, width
        self._fed: list[int] = []  # fed by the last propose, beyond pc.tokens
        self._drafts: list[mx.array] = []  # drafted tokens also fed (all but the last)
        # Where propose started, for a cache that cannot trim.
        self._snapshot: Snapshot | None = None

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[mx.array, mx.array | None]:
        self._fed = history[len(self.pc.tokens) :]  # at least the last token
        if not is_trimmable(self.pc.cache):
            self._snapshot = self.pc.snapshot()
        x = mx.array(self._fed, dtype=mx.int32)
        tokens: list[mx.array] = []
        dists: list[mx.array | None] = []
        for _ in range(k):
            logits = self.model(x[None], self.pc.cache)[0, -1:]  # (1, V_draft): last position only
            token, dist = sample(_fit_width(logits, self.width))
            tokens.append(token)
            dists.append(dist)
            x = token
        self._drafts = tokens[:-1]
        return mx.concatenate(tokens), _stacked(dists)

    def feed(self, ids: list[int]) -> None:
        """Read ``ids`` (the next tokens of the history) into the cache, without proposing."""
        prefill(self.model, self.pc, ids, checkpoint=False)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.pc.cache)

    def rewind(self, kept: list[int]) -> None:
        # Drafts: evaluated by now; int32 scalars, so ints (MLX's stub says any scalar).
        held = self.pc.tokens + self._fed + [cast(int, t.item()) for t in self._drafts]
        self.pc.tokens, self._fed, self._drafts = held, [], []
        n = 0
        for a, b in zip(held, kept):
            if a != b:
                break
            n += 1
        rewind(self.model, self.pc, n, self._snapshot)


def _stacked(dists: list[mx.array | None]) -> mx.array | None:
    """The (m, V) log-probs of m drafted tokens, or None: a draft sampler gives them for every
    token or, greedy, for none."""
    return mx.concatenate(cast("list[mx.array]", dists)) if dists[0] is not None else None


def _fit_width(logits: mx.array, width: int) -> mx.array:
    """Draft logits over the target's vocabulary width (padded embeddings differ per model size)."""
    V = logits.shape[-1]
    if V > width:
        return logits[:, :width]
    if V < width:
        return mx.concatenate(
            [logits, mx.full((logits.shape[0], width - V), -mx.inf, logits.dtype)], axis=-1
        )
    return logits


def check_vocabulary(target_tokenizer, draft_tokenizer) -> None:
    """Raise :class:`DraftError` unless both tokenizers map every id to the same token."""
    t, d = target_tokenizer, draft_tokenizer
    why = None
    if t.vocab_size != d.vocab_size:
        why = f"{d.vocab_size} tokens vs the target's {t.vocab_size}"
    else:
        for i in range(t.vocab_size):
            a, b = d.id_to_token(i), t.id_to_token(i)
            if a != b:
                why = f"token {i} is {a!r} in the draft, {b!r} in the target"
                break
    if why is not None:
        raise DraftError(
            f"draft model {_name(d)} and target {_name(t)} have different vocabularies ({why}); "
            "speculative decoding needs the same tokenizer"
        )


def _name(tokenizer) -> str:
    return str(getattr(tokenizer, "path", None) or "(unnamed)")


# --- Prompt lookup -------------------------------------------------------------------------------


class PromptLookup(Draft):
    """Draft by copying: match the last ``max_ngram`` … ``min_ngram`` tokens earlier in the
    prompt or output and propose the tokens that followed the latest match."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, model, cache: list[LayerCache], prompt: list[int]) -> Drafter:
        return _LookupDrafter(self.max_ngram, self.min_ngram)


class _LookupDrafter:
    def __init__(self, max_ngram: int, min_ngram: int):
        # n -> {n-gram: position right after its latest occurrence}; history only
        # grows (rejected drafts never enter it), so the index grows incrementally.
        self.index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(max_ngram, min_ngram - 1, -1)
        }
        self.indexed = 1  # continuation positions < indexed are in the index

    def propose(self, history: list[int], k: int, sample: DraftSampler) -> tuple[mx.array, None]:
        T = len(history)
        for j in range(
            self.indexed, T
        ):  # j: a position whose token continues the n-grams before it
            for n, table in self.index.items():
                if j >= n:
                    table[tuple(history[j - n : j])] = j
        self.indexed = T
        for n, table in self.index.items():  # longest n-gram first
            at = table.get(tuple(history[T - n :])) if T >= n else None
            if at is not None:
                return mx.array(history[at : at + k], dtype=mx.int32), None
        return _NO_TOKENS, None

    def rewind(self, kept: list[int]) -> None:
        pass  # no cache


# --- Self-drafting -------------------------------------------------------------------------------


class SelfDraft(Draft):
    """Draft with the target's first ``layers`` blocks, its final norm and its LM head."""

    def __init__(self, layers: int):
        self.layers = layers

    def check(self, model, tokenizer) -> None:
        self.view(model)

    def start(self, model, cache: list[LayerCache], prompt: list[int]) -> Drafter:
        return _SelfDrafter(self.view(model), cache, self.layers)

    def view(self, model):
        """The model that drafts: ``model``'s first ``layers`` blocks, then its final norm and
        head. A model split across ranks (``distributed/``) makes its own view, whose every
        step is a collective, or refuses with a DraftError: its ``first_blocks(n)``."""
        own = getattr(model, "first_blocks", None)
        return own(self.layers) if own is not None else first_blocks(model, self.layers)


def first_blocks(model, n: int):
    """A view of ``model`` that runs only its first ``n`` blocks, then its own final norm
    and head: shallow copies of the model and of the module holding the blocks, with
    that list cut. The weights are shared; the family's own forward pass runs."""
    blocks = model.layers
    if not 1 <= n < len(blocks):
        raise DraftError(
            f"self-draft layers must be between 1 and {len(blocks) - 1} for this "
            f"{len(blocks)}-layer model, got {n}"
        )
    for (
        name,
        inner,
    ) in model.items():  # the child module that holds the blocks (model.model, model.transformer…)
        if isinstance(inner, nn.Module):
            for attr, value in inner.items():
                if value is blocks:
                    inner = copy.copy(inner)
                    setattr(inner, attr, blocks[:n])
                    view = copy.copy(model)
                    setattr(view, name, inner)
                    return view
    raise DraftError(f"self-drafting: cannot find the list of blocks in {type(model).__module__}")


class _SelfDrafter:
    def __init__(self, view, cache: list[LayerCache], n: int):
        # The view runs with the target's whole cache list (masks may come from any
        # layer's cache); only the first n caches are written, and they are shared.
        self.view, self.cache, self.n = view, cache, n

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[mx.array, mx.array | None]:
        # The shared layers hold all of history but its last token, like the target's.
        x = mx.array(history[-1:], dtype=mx.int32)
        tokens: list[mx.array] = []
        dists: list[mx.array | None] = []
        saved = snapshot_cache(self.cache[: self.n])
        for _ in range(k):
            token, dist = sample(
                self.view(x[None], self.cache)[0, -1:]
            )  # (1, V): one token at a time
            tokens.append(token)
            dists.append(dist)
            x = token
        # Drop what drafting wrote (history's last token, then k-1 drafts): the
        # verification pass writes those positions again, for every layer.
        restore_cache(self.cache[: self.n], saved)
        return mx.concatenate(tokens), _stacked(dists)

    def rewind(self, kept: list[int]) -> None:
        pass  # its cache is the target's, which the runner rewinds


# --- Multi-token prediction heads ----------------------------------------------------------------
