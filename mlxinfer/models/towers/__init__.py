"""Vision towers and projectors: images (pixel values) in, the language model's embeddings out.

Each is an MLX module under the checkpoint's own parameter names; the family module that
composes a language model with one (``models/gemma3.py``) fixes their weights in its
``sanitize``. Pixel values come already prepared (``mlxinfer.vision``, a package below this one).
"""
