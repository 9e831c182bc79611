"""Samplers and logits processors: plain functions built once per request.

The filters follow transformers' warpers, applied in this order: temperature,
top-k, top-p, min-p. ``filtered_logprobs`` returns the distribution a sampler
draws from, so tests (and speculative decoding, which needs the target's and
the draft's exact distributions) can use it directly.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, fields
from typing import Callable

import mlx.core as mx

from .. import backends

Sampler = Callable[
    [mx.array], mx.array
]  # (B, V) log-probs, normalised or not (logits) -> (B,) token ids
LogitsProcessor = Callable[
    [mx.array, mx.array], mx.array
]  # (tokens so far, (B, V) logits) -> logits

NEG_INF = float("-inf")


def filtered_logprobs(
    logprobs: mx.array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> mx.array:
    """Normalised log-probs after temperature, top-k, top-p and min-p (B, V)."""
    x = logprobs / temperature if temperature not in (0.0, 1.0) else logprobs
    if 0 < top_k < x.shape[-1]:
        # Keep the k largest: everything below the k-th largest value is dropped.
        kth = mx.sort(x, axis=-1)[..., -top_k][..., None]
        x = mx.where(x < kth, NEG_INF, x)
    if top_p < 1.0:
        # Keep the smallest set of most-likely tokens whose mass reaches top_p:
        # a token stays if the mass strictly before it (descending) is < top_p.
        order = mx.argsort(-x, axis=-1)
        sorted_x = mx.take_along_axis(x, order, axis=-1)
        p = mx.softmax(sorted_x, axis=-1, precise=True)
        mass_before = mx.cumsum(p, axis=-1) - p
        keep_sorted = mass_before < top_p
        keep = mx.put_along_axis(mx.zeros(x.shape, mx.bool_), order, keep_sorted, axis=-1)
        x = mx.where(keep, x, NEG_INF)
    if min_p > 0.0:
        # Drop tokens less likely than min_p × the most likely one.
        threshold = mx.max(x, axis=-1, keepdims=True) + mx.log(mx.array(min_p, x.dtype))
        x = mx.where(x < threshold, NEG_INF, x)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling settings as one object; a sampler keeps its own as ``sampler.params``.

    Speculative decoding reads them to build the exact distribution the plain
    sampler would draw from (for the target and the draft alike).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None  # transformers' rule; None or 1.0: off
    repetition_context_size: int | None = None  # the last tokens it looks at; None: all

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check(self) -> None:
        """Raise ValueError naming the first setting out of range."""
        if not 0 <= self.temperature < math.inf:  # NaN fails both comparisons
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def filter(self, logprobs: mx.array) -> mx.array:
        """The (B, V) log-probs a sampler with these settings draws from."""
        return filtered_logprobs(
            logprobs,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
        )

    def sampler(self) -> Sampler:
        """A fresh sampler with these settings (its own random key)."""
        return make_sampler(
            self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, seed=self.seed
        )

    def processors(self) -> list[LogitsProcessor]:
        """The logits processors these settings ask for (a repetition penalty, or none)."""
        return make_logits_processors(
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
        )


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def make_sampler(
    temperature: float = 0.0,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int | None = None,
) -> Sampler:
    """Greedy when ``temperature == 0``; otherwise draws from ``filtered_logprobs`` (on the CPU
    backend by one kernel call: ``backends.sample``).

    The random key lives in the returned closure, so two samplers with the same
    seed give the same tokens and no global RNG state is touched. The settings
    are kept as ``sampler.params`` (a :class:`SamplingParams`).
    """
    params = SamplingParams(temperature, top_k, top_p, min_p, seed)
    params.check()
    if temperature == 0:

        def argmax(logprobs: mx.array) -> mx.array:
            return mx.argmax(logprobs, axis=-1)

        # Kept on the function (speculative decoding reads it); mypy has no attributes on functions.
        argmax.params = params  # type: ignore[attr-defined]
        return argmax
    state = {"key": mx.random.key(secrets.randbits(63) if seed is None else seed)}

    def sample(logprobs: mx.array) -> mx.array:
        state["key"], sub = mx.random.split(state["key"])
        # The CPU backend draws from the same distribution in one kernel call (MLX's sort and
        # Gumbel draw cost more than a small model's decode step there); None elsewhere.
        token = backends.sample(
            logprobs, sub, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
        )
        if token is not None:
            return token
        return mx.random.categorical(params.filter(logprobs), axis=-1, key=sub)

    sample.params = params  # type: ignore[attr-defined]  # as argmax.params above
    return sample


def make_repetition_penalty(penalty: float, context_size: int | None = None) -> LogitsProcessor:
    """transformers' rule: a seen token's logit is divided by ``penalty`` if
    positive, multiplied if negative. ``context_size`` limits "seen" to the last
    tokens (None: the whole sequence)."""
    if penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {penalty}")

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        seen = tokens if context_size is None else tokens[-context_size:]
        picked = logits[:, seen]
        picked = mx.where(picked < 0, picked * penalty, picked / penalty)
        logits[:, seen] = picked
        return logits

    return process


def make_logits_processors(
    *, repetition_penalty: float | None = None, repetition_context_size: int | None = None
) -> list[LogitsProcessor]:
    processors: list[LogitsProcessor] = []
    if repetition_penalty is not None and repetition_penalty != 1.0:
        processors.append(make_repetition_penalty(repetition_penalty, repetition_context_size))
    return processors
