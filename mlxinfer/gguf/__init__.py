"""GGUF files (llama.cpp's format) into mlxinfer model directories.

- ``container.py``: the file's header (metadata, tensor directory) and each tensor's bytes,
  every size and offset checked against the file (a hostile file is a one-line error);
- ``metadata.py``: typed, range-checked reads of the metadata that becomes config and vocabulary;
- ``importer.py``: the import itself (``import_gguf``): the file checked, the directory written;
- ``tensors.py``: one tensor into the arrays stored (kept quantized, K-quant losses measured,
  fused experts joined);
- ``quants.py``: every supported block type decoded, and turned into MLX affine groups;
- ``names.py``: the ``SUPPORTED`` architectures, their tensor names and the notes on what each
  file holds; ``arch.py`` maps the names and applies the per-architecture weight fixes
  (Qwen3.5/Qwen3-Next's in ``qwen35.py``, DeepSeek's in ``deepseek2.py``);
- ``arch_config.py``: config.json from the metadata, the keys every architecture has;
  ``arch_families.py`` each family's own and what llama.cpp hard-codes; ``lookups.py`` the
  typed lookups and the bounds on every size; ``rope_freqs.py`` Llama 3.1's RoPE scaling from
  its tensor;
- ``vocab.py``: the vocabulary rebuilt as a ``tokenizer.json`` (byte-level BPE split as
  ``pretokenizers.py`` says for the file's ``tokenizer.ggml.pre``);
- ``dense.py``: the import to a float dtype (``--dtype``), optionally quantized afresh.
"""

from .container import GGUFTensor, read_gguf_header
from .importer import import_gguf

__all__ = ["GGUFTensor", "import_gguf", "read_gguf_header"]
