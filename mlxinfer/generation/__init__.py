"""Generation: from a prompt's token ids to a stream of results, generators all the way up.

- ``prefill``: the one function that feeds a prompt into a cache, for every loop;
- ``loop``: ``generate_step`` (the token loop), ``stream_generate`` (prepare → steps →
  results) and ``generate``;
- ``request``: one request around the loop, shared with the batch engine: ``prepare_request``
  (output rules, the prompt's ids through ``prepare_prompt``, fitted in the context and the KV
  room) gives a ``PreparedRequest``, whose ``results`` turns the loop's steps into text results
  (stop strings, EOS, the timeline, tool calls, reasoning);
- ``images``: a request's images (``stream_generate(images=...)``): decoded and processed
  (``mlxinfer.vision``), placed in the prompt, encoded by the model's tower and prefilled in
  chunks that never split one, on a fresh cache (never reused across images);
- ``speculative``: the sibling loop that drafts, verifies and accepts, with the same outputs;
- ``drafts``: where drafts come from (a draft model, prompt lookup, a self-draft; ``mtp_drafts``: MTP heads);
- ``rules``: a request's output rules (``OutputRules``: stop strings, structured output, tools,
  reasoning), one object or loose keywords;
- ``sampling``: a request's sampling settings (``SamplingParams``), samplers and processors;
- ``stop``: stop strings, matched without leaking a partial match;
- ``results``: the shared types (``Step``, ``GenerationResult``, ``GenerationStats``), a leaf.

Data flows one way: the loops import the shared types and prefill, and report what they
did in what they yield.
"""

from .loop import generate, generate_step, prepare_prompt, stream_generate
from .request import PreparedRequest, prepare_request
from .rules import OutputRules

__all__ = [
    "OutputRules",
    "PreparedRequest",
    "generate",
    "generate_step",
    "prepare_prompt",
    "prepare_request",
    "stream_generate",
]
