"""Text to token ids and back: the tokenizer a checkpoint ships, its chat template, and streaming text.

- ``tokenizer.py``: ``Tokenizer``, the one front for every vocabulary kind;
- ``tokenizer_config.py``: the Hugging Face side files (tokenizer_config.json, special tokens,
  added tokens, EOS ids), read and checked;
- ``tokenizers_backend.py``, ``sentencepiece_backend.py``, ``tiktoken_backend.py``: the
  vocabularies (``tokenizer.json`` through the Hugging Face ``tokenizers`` package,
  SentencePiece, tiktoken);
- ``chat_template.py``: chat templates, rendered as transformers renders them, in a sandbox;
- ``detokenizer.py``: token ids to UTF-8-safe text, one token at a time.

Not named ``tokenizers``: that would shadow the Hugging Face package.
"""

from .tokenizer import Tokenizer

__all__ = ["Tokenizer"]
