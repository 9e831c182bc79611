"""The engine's text side: a prompt (text, token ids or chat messages) in, ``stream_generate``'s
results out, for one request running inside the batch.

:class:`TextRequests` is :class:`~mlxinfer.batch.engine.Engine`'s ``frontend``: it prepares a
request (``generation.request.prepare_request``, as the single-request loop does: the chat
template, tools, the context's and the pool's room), submits its token ids, and reads its steps
back through ``PreparedRequest.results``: detokenized, cut at stop strings, with tool calls parsed,
structured output constrained and reasoning split. The scheduler itself sees token ids only.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from ..generation.drafts import Draft
from ..generation.images import images_in_messages, load_images
from ..generation.request import KVRoom, prepare_request
from ..generation.results import GenerationResult
from ..generation.rules import OutputRules
from ..generation.sampling import SamplingParams
from ..output.constraints.spec import Constraint
from .requests import Handle, Stream


class TextRequests:
    """``start`` and ``stream`` over an engine's ``submit``, for ``model``, whose requests may
    hold ``room`` tokens (prompt and output) at most."""

    def __init__(self, model, submit: Callable[..., Handle], room: int) -> None:
        self.model, self.submit, self.room = model, submit, room

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
        output: OutputRules | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        images: Sequence[Any] | None = None,
        **constraint_options,
    ) -> Stream:
        """Submit one request now; its :class:`Stream` of ``stream_generate``'s results, which
        any thread may :meth:`~Stream.cancel` (``draft``, ``num_draft``: as for
        :meth:`submit`; ``constraint`` or one of ``response_format``, ``json_schema``,
        ``regex``, ``choices``, ``grammar``: structured output, as for ``stream_generate``;
        ``tools``, ``tool_choice``, ``split_reasoning``, ``chat_template_kwargs``, ``output``:
        likewise; ``images``: paths, bytes, data URLs, Pillow or decoded images, as for
        ``stream_generate``, decoded and processed here, on the caller's thread)."""
        # The pool's room caps max_tokens (an agent's max_tokens of 32,000 past a small budget
        # ends as "length"); a prompt it can never hold is submit's to refuse (check_fits).
        room = KVRoom(self.room)
        prompt, in_parts = images_in_messages(prompt)  # image parts of the messages: markers
        images = images or in_parts
        prompt_images = load_images(self.model, tokenizer, images) if images else None
        request = prepare_request(
            self.model,
            tokenizer,
            prompt,
            max_tokens=max_tokens,
            sampling=sampling,
            output=output,
            chat_template=chat_template,
            truncate_prompt=truncate_prompt,
            kv_room=room,
            stop=stop,
            constraint=constraint,
            tools=tools,
            tool_choice=tool_choice,
            split_reasoning=split_reasoning,
            chat_template_kwargs=chat_template_kwargs,
            images=prompt_images,
            **constraint_options,
        )
        handle = self.submit(
            request.ids,
            max_tokens=request.max_tokens,
            sampling=request.sampling,
            eos=request.eos,
            draft=draft,
            num_draft=num_draft,
            logits_processors=request.logits_processors,
            images=prompt_images,
        )
        return Stream(handle, request.results(handle.steps(timeout)))
