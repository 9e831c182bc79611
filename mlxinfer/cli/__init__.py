"""The ``mlxinfer`` command: the group and generate/chat (``main.py``), the shared options,
limits, serve, bench and the distributed launch. ``mlxinfer.cli:main`` is the entry point."""

from .main import main  # noqa: F401
