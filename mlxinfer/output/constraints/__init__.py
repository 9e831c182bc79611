"""Structured output: constraints enforced while sampling, with llguidance.

- ``spec.py``: :class:`Constraint`, what the output must match (JSON Schema, any JSON
  object, a regex, a choice, a grammar), compiled and checked when made;
- ``matcher.py``: the logits processor that holds one request's matcher and masks what the
  grammar forbids at each step (plain decoding, the batch, speculative verification).
"""

from .spec import Constraint, from_options

__all__ = ["Constraint", "from_options"]
