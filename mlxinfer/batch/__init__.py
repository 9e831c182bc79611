"""Continuous batching: many requests in one decode step, over a paged KV pool.

- :mod:`.pool` — the blocks, block tables, prefix sharing and accounting;
- :mod:`.views` — one forward over the pool, behind the cache protocol;
- :mod:`.config` — the engine's settings (:class:`EngineConfig`);
- :mod:`.engine` — the engine, the caller's side: submit, statistics, metrics, close;
- :mod:`.scheduler` — its thread: admit, prefill in chunks, decode B rows, retire;
- :mod:`.parts`, :mod:`.pools` — what a config makes of a model: its pools, snapshots, draft pools;
- :mod:`.verification`, :mod:`.flights` — the scheduler's members for drafting rows and for
  flights across pipeline ranks;
- :mod:`.frontend` — a prompt in, ``stream_generate``'s results out (``Engine.start``, ``stream``);
- :mod:`.draft_pool` — a draft model's own pool, whose rows propose together;
- :mod:`.requests` — a request as the engine keeps it, and the caller's handle on it;
- :mod:`.snapshots`, :mod:`.recurrent` — recurrent states at block boundaries: prefix reuse and
  drafting for models with recurrent layers;

``batch_generate`` runs a list of prompts through one engine and returns their texts. With a
model loaded across ranks (``load(path, distributed=...)``), every rank runs the same call and
the engines take rank 0's turns (``mlxinfer/distributed/batching.py``, docs/distributed.md).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..generation.drafts import Draft, DraftModel
from ..generation.rules import OutputRules
from ..generation.sampling import SAMPLING_FIELDS, SamplingParams
from ..output.constraints import Constraint
from .config import EngineConfig
from .engine import Engine
from .pool import KVPool, PoolFullError, PoolStats
from .requests import EngineError, Handle, Stream

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "Handle",
    "KVPool",
    "PoolFullError",
    "PoolStats",
    "Stream",
    "batch_generate",
]


def batch_generate(
    model,
    tokenizer,
    prompts: Sequence[str | Sequence[int] | Sequence[dict[str, Any]]],
    *,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
    chat_template: bool = False,
    truncate_prompt: bool = False,
    kv_budget: int | None = None,
    kv_bits: int | None = None,
    max_batch: int | None = None,
    sampling: SamplingParams | None = None,
    draft: Draft | None = None,
    num_draft: int | None = None,
    constraint: Constraint | None = None,
    output: OutputRules | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    micro_batches: bool | None = None,
    images: Sequence[Any] | None = None,
    **sampling_options,
) -> list[str]:
    """Complete every prompt (text, token ids or chat messages) in one batch; the texts,
    in order. Takes ``generate``'s sampling options (``temperature``, ``top_p``, ``seed``, …);
    a ``seed`` seeds every request alike. ``kv_bits``: the pool stores 8- or 4-bit keys and
    values. ``draft=PromptLookup()``, ``DraftModel(...)`` or ``MTP()``: every request drafts by
    prompt lookup, with that draft model, whose steps the requests share, or with the model's
    own MTP head (``num_draft`` tokens per step, or adaptive). ``constraint``: every request's output must match it
    (each request has its own matcher). ``output``, ``chat_template_kwargs``: the output rules
    as one :class:`~mlxinfer.generation.rules.OutputRules`, more chat-template variables: as for
    ``stream_generate``. ``micro_batches``: the engine's (a pipeline's flights). ``images``: for
    a model with a vision tower, images for every prompt (as ``stream_generate``'s), decoded
    once: the tower sees each once (the engine's encoder cache) and the prompts share the
    blocks up to their own text (docs/batching.md, requests with images)."""
    unknown = set(sampling_options) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"batch_generate: unexpected option(s) {', '.join(sorted(unknown))}")
    if sampling is not None and sampling_options:
        raise ValueError("sampling: given as one SamplingParams, and also as separate options")
    sampling = sampling or SamplingParams(**sampling_options)
    output = OutputRules.merge(output, {"stop": stop, "constraint": constraint})
    if draft is not None:
        draft.check(model, tokenizer)  # a draft model's vocabulary: DraftError naming both
    options = {}
    if kv_budget is not None:
        options["kv_budget"] = kv_budget
    if max_batch is not None:
        options["max_batch"] = max_batch
    if kv_bits is not None:
        options["kv_bits"] = kv_bits
    if micro_batches is not None:
        options["micro_batches"] = micro_batches
    if isinstance(draft, DraftModel):  # its pool inside kv_budget (the Engine's rule)
        options["draft_models"] = [draft.model]
    if images:
        from ..vision import Image, load_image

        images = [
            s if isinstance(s, Image) else load_image(s, label=f"image {i + 1}")
            for i, s in enumerate(images)
        ]
    with Engine(model, **options) as engine:
        # Every request submitted before any is read (``start``, not ``stream``: a stream's
        # generator submits on its first next(), which returns with the request's first token,
        # so the requests were admitted one at a time, each prefilled alone between decode
        # steps of the ones before it).
        streams = [
            engine.start(
                tokenizer,
                p,
                max_tokens=max_tokens,
                sampling=sampling,
                output=output,
                chat_template=chat_template,
                truncate_prompt=truncate_prompt,
                draft=draft,
                num_draft=num_draft,
                chat_template_kwargs=chat_template_kwargs,
                images=images or None,
            )
            for p in prompts
        ]
        texts = []
        for stream in streams:
            try:
                texts.append("".join(r.text for r in stream))
            finally:
                stream.cancel()  # a stop string ended it early: its blocks go back now
        return texts
