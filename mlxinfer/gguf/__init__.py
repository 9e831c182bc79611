"""GGUF files (llama.cpp's format) into mlxinfer model directories.

- ``importer.py``: reading the container and the import itself (``import_gguf``);
- ``quants.py``: every supported block type decoded, and turned into MLX affine groups;
- ``arch.py``: architecture names, config and per-architecture fixes (llama, gemma3);
- ``vocab.py``: the vocabulary rebuilt as a ``tokenizer.json``;
- ``dense.py``: the import to a float dtype (``--dtype``), optionally quantized afresh.
"""

from .importer import GGUFTensor, import_gguf, read_gguf_header

__all__ = ["GGUFTensor", "import_gguf", "read_gguf_header"]
