"""MTP drafting: the multi-token-prediction head a checkpoint ships (or ``train-mtp`` trained)
as a draft source (``MTP``), and one request's drafter over it (``_MTPDrafter``: the head's
cache, the pairs it reads lazily, chained drafts). The head itself: ``models/layers/mtp.py``;
the other draft sources: ``drafts.py``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..cache.fingerprint import sampled_weights
from ..cache.kv import LayerCache, is_trimmable
from ..cache.prompt import PromptCache
from ..errors import DraftError
from ..models.layers.mtp import HEAD_FILE, attach_head
from .drafts import _NO_TOKENS, Draft, Drafter, DraftSampler, _stacked


class MTP(Draft):
    """Draft with the multi-token-prediction (MTP) head the checkpoint ships (MiMo, GLM-4.5,
    DeepSeek-V3, Qwen3-Next, Qwen3.5: ``docs/models.md``).

    The head reads the trunk's final hidden state at position j and the token at j+1 and
    predicts the token at j+2; for k > 1 it is chained on its own output (``layers/mtp.py``).
    Its cache is primed over the prompt during the prefill.

    A model that ships no heads drafts with one trained for it by ``mlxinfer train-mtp``: the
    file ``head`` names, else ``mtp_head.safetensors`` in the model's directory.

    Args:
        head: a trained head's file (``train-mtp -o``) for a model without shipped heads.
        keep_cache: keep the head's cache for the next request (chat turns): when that one
            reuses a prefix of the target's cache, the head resumes from its own instead of
            not having seen the prefix (the target feeds the prefix's last token again, one
            token, so that its state pairs with the next). One request at a time; not across
            state (recurrent) caches, which cannot give a token back. Either way the drafts are
            verified: this only changes acceptance.
    """

    def __init__(self, keep_cache: bool = False, head: str | os.PathLike | None = None):
        self.keep_cache = keep_cache
        self.head = head
        self._kept: _MTPDrafter | None = None  # the last request's, with keep_cache
        self._digest: tuple[nn.Module, str] | None = None  # (a head's block, head_digest)

    def check(self, model, tokenizer) -> None:
        where = getattr(model, "source_dir", None) or type(model).__module__
        if getattr(model, "backend", None) == "distributed":  # distributed/pipeline.RankModel
            raise DraftError(f"model {where}: MTP drafting does not run across ranks yet")
        if self.head is None and getattr(model, "mtp_heads", None):
            return  # shipped heads, or a trained one attached already
        trained = Path(self.head) if self.head is not None else None
        if trained is None and getattr(model, "source_dir", None) is not None:
            beside = Path(model.source_dir) / HEAD_FILE
            trained = beside if beside.is_file() else None
        if trained is None:
            raise DraftError(
                f"model {where} has no MTP heads (expected a family that keeps them, such as "
                f"mimo, with its MTP weights, or a head from 'mlxinfer train-mtp' in "
                f"{HEAD_FILE}); --mtp needs them"
            )
        if getattr(model, "attached_mtp_head_path", None) != trained:
            attach_head(model, trained)

    def start(self, model, cache: list[LayerCache], prompt: list[int]) -> Drafter:
        self.check(model, None)
        drafter = _MTPDrafter(model.mtp_heads[0], self._kept)  # one head, chained for k > 1
        if self.keep_cache:
            self._kept = drafter
        return drafter

    # --- Kept across processes: a prompt cache file's head section (cache/prompt_file.py) ---

    def head_state(self) -> tuple[LayerCache, dict[str, str]] | None:
        """The kept head cache (``keep_cache``) for a prompt cache file to keep beside the
        target's: (its cache, {"digest", "tokens", "first"}), or None when there is none a
        later :meth:`resume` could take (none kept, or one that started past the first pair)."""
        k = self._kept
        if k is not None:
            k.flush()
        if k is None or k.first != 0 or k.cache.offset == 0:
            return None
        meta = {"digest": self.head_digest(k.head), "first": str(k.first)}
        meta["tokens"] = ",".join(map(str, k.tokens))
        return k.cache, meta

    def restore_head_state(self, model, cache: list[LayerCache], meta: dict[str, str]) -> str:
        """Take a head cache :meth:`head_state` gave (read back from a file) as the kept one,
        for the next request to resume from. Returns what was done, in a line: taken, or why
        not (another head's, not the head's arrays). Not taking it changes no output: the head
        starts where the prefill does, as without a file."""
        try:
            self.check(model, None)
        except DraftError:
            return "MTP head cache not used: the model has no MTP head"  # start() says so
        head = model.mtp_heads[0]
        if meta.get("digest") != self.head_digest(head):
            return "MTP head cache not used: written for another MTP head"
        try:
            tokens = [int(t) for t in meta.get("tokens", "").split(",") if t]
            first = int(meta.get("first", ""))
            [c] = cache
            want = _one_pair(head)
            if type(c) is not type(want) or first != 0 or c.offset != len(tokens) - 1 - first:
                raise ValueError(f"{type(c).__name__} of {c.offset} pairs")
            got, expected = list(c.state), list(want.state)
            if len(got) != len(expected) or any(
                a.dtype != b.dtype or a.shape[:2] + a.shape[3:] != b.shape[:2] + b.shape[3:]
                for a, b in zip(got, expected)
            ):
                raise ValueError("not the head's arrays")
        except ValueError as e:
            return f"MTP head cache not used: {e}"
        drafter = _MTPDrafter(head)
        drafter.cache, drafter.tokens, drafter.first = c, tokens, first
        self._kept = drafter
        return f"MTP head cache: {c.offset} pairs read back"

    def head_digest(self, head) -> str:
        """What a head's kept cache is keyed by: its layout and a sample of its weights
        (``fingerprint.sampled_weights``); computed once per head."""
        if self._digest is None or self._digest[0] is not head.block:
            h = hashlib.sha256(repr(head.spec).encode())
            params = cast("list[tuple[str, mx.array]]", tree_flatten(head.block.parameters()))
            h.update(sampled_weights(params).encode())
            self._digest = (head.block, h.hexdigest())
        return self._digest[1]

    def drafter(self, model) -> _MTPDrafter:
        """A drafter for one row of the batching engine, which hands it the row's hidden
        states (``observe``) as its prefill and verification steps go; never ``keep_cache``'s."""
        self.check(model, None)
        return _MTPDrafter(model.mtp_heads[0])


def _one_pair(head) -> LayerCache:
    """``head``'s cache after one pair: the arrays a kept cache's must match (but the length)."""
    cache = head.make_cache()
    e = head.embed(mx.array([[0]], dtype=mx.int32))  # (1, 1, H)
    mx.eval(head(mx.array([[0]], dtype=mx.int32), mx.zeros_like(e), cache))
    return cache


# Pairs an MTP head lets wait before it runs them (_MTPDrafter.observe): a plain run of up to
# MAX_PROBE steps, or a prefill chunk, waits whole (its states: 512 x hidden floats at most).
FLUSH_PAIRS = 512


class _MTPDrafter:
    def __init__(self, head, kept: _MTPDrafter | None = None):
        self.head, self.cache, self.kept = head, head.make_cache(), kept
        # The head's post-norm output g at the last real pair (trunk state, next token): its
        # logits are the first draft's; None until a pair has been read.
        self.g: mx.array | None = None
        # x_0 … the last token paired: pair j (the cache's entry j - first) read tokens[j + 1].
        self.tokens: list[int] = []
        self.first = 0  # the trunk position of the cache's first pair
        # Pairs read but not yet run through the head: it runs them when it next drafts (or
        # FLUSH_PAIRS are waiting), in one call, so steps that do not draft cost it nothing.
        self.pending: list[tuple[mx.array, list[int]]] = []
        self.waiting = 0  # pairs in pending

    def resume(self, pc: PromptCache, prompt: list[int], todo: list[int]) -> list[int]:
        """Before the prefill (``pc`` reused ``prompt``'s prefix, ``todo`` is left): take the
        kept cache's pairs over that prefix, if it has them, and give the prefix's last token
        back to ``pc`` so its state pairs with the next. Returns the ids to feed."""
        r = len(prompt) - len(todo)  # tokens reused
        k = self.kept
        if k is not None:
            k.flush()
        if (
            k is not None
            and r >= 2
            and k.first == 0
            and k.head.block is self.head.block
            and k.cache.offset >= r - 1
            and k.tokens[:r] == prompt[:r]
            and is_trimmable(pc.cache)
        ):
            pc.rewind(r - 1)
            self.cache = k.cache
            self.cache.trim(self.cache.offset - (r - 1))  # pairs 0 … r-2 (tokens x_1 … x_{r-1})
            self.tokens = list(prompt[:r])
            self.kept = None
            return list(prompt[r - 1 :])
        self.kept = None  # nothing to resume: the head starts at the first position fed
        self.first, self.tokens = r, list(prompt[: r + 1])
        return todo

    def observe(self, hidden: mx.array, following: list[int]) -> list[mx.array]:
        """Read the pairs (``hidden[i]``, ``following[i]``): kept until the head next drafts
        (:meth:`flush`), or run now when ``FLUSH_PAIRS`` wait (the arrays to evaluate)."""
        self.pending.append((hidden, list(following)))
        self.waiting += len(following)
        self.tokens += following
        if self.waiting >= FLUSH_PAIRS:
            return self.flush()
        return []

    def flush(self) -> list[mx.array]:
        """Run the pairs read since the last flush through the head, in one call: its cache
        and ``g`` up to date. Returns the arrays to evaluate (none when nothing waited)."""
        if not self.pending:
            return []
        hidden = mx.concatenate([h for h, _ in self.pending])  # (L, H)
        following = [t for _, f in self.pending for t in f]
        self.pending, self.waiting = [], 0
        tokens = mx.array(following, dtype=mx.int32)[None]  # (1, L)
        g = self.head(tokens, hidden[None], self.cache)  # (1, L, H)
        self.g = g[:, -1:]  # (1, 1, H)
        return [*self.cache.state, self.g]

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[mx.array, mx.array | None]:
        self.flush()
        if self.g is None:
            return _NO_TOKENS, None
        g, real = self.g, self.cache.offset
        tokens: list[mx.array] = []
        dists: list[mx.array | None] = []
        for i in range(k):
            if i:  # chained: the head's own output and the token it drafted, one position on
                g = self.head(tokens[-1][None], g, self.cache)  # (1, 1, H)
            token, dist = sample(self.head.logits(g)[0])  # (1, V)
            tokens.append(token)
            dists.append(dist)
        self.cache.trim(self.cache.offset - real)  # only real pairs stay (lazy graphs keep theirs)
        return mx.concatenate(tokens), _stacked(dists)

    def rewind(self, kept: list[int]) -> None:
        pass  # its cache holds only kept positions' pairs (observe)
