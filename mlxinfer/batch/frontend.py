"""The engine's text side: a prompt (text, token ids or chat messages) in, ``stream_generate``'s
results out, for one request running inside the batch.

:class:`TextRequests` is the part of :class:`~mlxinfer.batch.engine.Engine` that turns a prompt into
token ids (the chat template, tools, the context's room), submits them, and reads the request's
steps back as :class:`~mlxinfer.generation.results.GenerationResult`s: detokenized, cut at stop
strings, with tool calls parsed, structured output constrained and reasoning split, exactly as
the single-request loop does. The scheduler itself sees token ids only.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

from ..generation.drafts import Draft
from ..generation.loop import _Request as _Prepared
from ..generation.loop import _results, prepare_prompt
from ..generation.prompt import fit_context
from ..generation.results import GenerationResult, GenerationStats
from ..generation.sampling import SamplingParams
from ..generation.stop import StopMatcher
from ..output.constraints.spec import Constraint
from ..output.reasoning import split_results, splitter_for
from ..output.toolcalls import output_rules
from .requests import Stream


class TextRequests:
    """``start`` and ``stream`` over the engine's ``submit`` (mixed into ``Engine``)."""

    def stream(self, tokenizer, prompt, **options) -> Iterator[GenerationResult]:
        """``stream_generate``'s results for one request run inside the batch: :meth:`start`'s
        stream, started on the first ``next()`` (so a bad prompt fails there)."""
        stream = self.start(tokenizer, prompt, **options)
        try:
            yield from stream
        finally:
            stream.cancel()  # a stop string or the caller ended it early: free its blocks

    def start(
        self,
        tokenizer,
        prompt: str | Sequence[int] | Sequence[dict[str, Any]],
        *,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        chat_template: bool = False,
        truncate_prompt: bool = False,
        timeout: float | None = None,
        draft: Draft | None = None,
        num_draft: int | None = None,
        constraint: Constraint | None = None,
        tools: list[dict] | None = None,
        tool_choice: Any = None,
        split_reasoning: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        **constraint_options,
    ) -> Stream:
        """Submit one request now; its :class:`Stream` of ``stream_generate``'s results, which
        any thread may :meth:`~Stream.cancel` (``draft``, ``num_draft``: as for
        :meth:`submit`; ``constraint`` or one of ``response_format``, ``json_schema``,
        ``regex``, ``choices``, ``grammar``: structured output, as for ``stream_generate``;
        ``tools``, ``tool_choice``, ``split_reasoning``, ``chat_template_kwargs``: likewise)."""
        t0 = time.perf_counter()
        constraint, tooling = output_rules(
            tokenizer, tools, tool_choice, constraint=constraint, **constraint_options
        )
        extra = [constraint.processor(tokenizer)] if constraint is not None else []
        ids = prepare_prompt(
            tokenizer,
            prompt,
            chat_template=chat_template,
            tools=tooling.tools if tooling is not None else None,
            chat_template_kwargs=chat_template_kwargs,
        )
        context = self.model.args.max_position_embeddings
        ids = fit_context(ids, context, max_tokens, truncate=truncate_prompt)
        max_tokens = min(max_tokens, context - len(ids))
        # ... and to what the KV budget can ever hold (submit's check_fits), when the prompt
        # itself fits: an agent's max_tokens of 32,000 past a small budget ends as "length".
        budget = self.pool.max_blocks * self.pool.block_size - self.max_draft - len(ids)
        if budget > 0:
            max_tokens = min(max_tokens, budget)
        stats = GenerationStats(
            prompt_tokens=len(ids), tokenize_ms=(time.perf_counter() - t0) * 1000
        )
        sampling = sampling or SamplingParams()
        handle = self.submit(
            ids,
            max_tokens=max_tokens,
            sampling=sampling,
            eos=tokenizer.eos_token_ids,
            draft=draft,
            num_draft=num_draft,
            logits_processors=extra,
        )
        prepared = _Prepared(
            ids,
            max_tokens,
            sampling,
            extra,
            None,
            stats,
            tokenizer.detokenizer(),
            StopMatcher(stop),
            tokenizer.eos_token_ids,
            t0,
        )
        results = _results(prepared, handle.steps(timeout), count_passes=False)
        if tooling is not None:
            results = tooling.results(results)
        if split_reasoning:
            results = split_results(results, splitter_for(tokenizer, ids))
        return Stream(handle, results)
