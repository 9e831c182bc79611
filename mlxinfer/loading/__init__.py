"""From a path, a Hub id or a ``.gguf`` to a model in memory: ``load`` (``loader.py``), the
memory checks, ``convert``, the default model and the GGUF import cache."""
