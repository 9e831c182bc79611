"""Old name of :mod:`mlxinfer.handle` (``ModelHandle``, ``astream_generate``), kept as an alias:
it was documented under this name."""

from .handle import ModelHandle, astream_generate  # noqa: F401
