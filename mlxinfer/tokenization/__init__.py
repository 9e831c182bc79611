"""Text to token ids and back: the tokenizer a checkpoint ships, its chat template, and streaming text.

- ``tokenizer.py``: ``Tokenizer``, the one front for every vocabulary kind;
- ``sentencepiece_backend.py``, ``tiktoken_backend.py``: the SentencePiece and tiktoken
  vocabularies (``tokenizer.json`` goes through the Hugging Face ``tokenizers`` package);
- ``chat_template.py``: chat templates, rendered as transformers renders them, in a sandbox;
- ``detokenizer.py``: token ids to UTF-8-safe text, one token at a time.

Not named ``tokenizers``: that would shadow the Hugging Face package.
"""

from .tokenizer import Tokenizer

__all__ = ["Tokenizer"]
