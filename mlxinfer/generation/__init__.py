"""Generation: from a prompt's token ids to a stream of results, generators all the way up.

- ``prefill``: the one function that feeds a prompt into a cache, for every loop;
- ``loop``: ``generate_step`` (the token loop), ``stream_generate`` (prepare → steps →
  results) and ``generate``;
- ``request``: one request around the loop: its prompt prepared (``prepare_prompt``, fitted
  in the context and the KV budget) and its steps turned into text results (stop strings, EOS,
  the timeline), shared with the batch engine;
- ``speculative``: the sibling loop that drafts, verifies and accepts, with the same outputs;
- ``drafts``: where drafts come from (a draft model, prompt lookup, a self-draft);
- ``sampling``: a request's sampling settings (``SamplingParams``), samplers and processors;
- ``stop``: stop strings, matched without leaking a partial match;
- ``results``: the shared types (``Step``, ``GenerationResult``, ``GenerationStats``), a leaf.

Data flows one way: the loops import the shared types and prefill, and report what they
did in what they yield.
"""

from .loop import generate, generate_step, prepare_prompt, stream_generate

__all__ = ["generate", "generate_step", "prepare_prompt", "stream_generate"]
