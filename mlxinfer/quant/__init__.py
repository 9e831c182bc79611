"""Quantization: the transform applied to a model and the record in ``config.json`` that
loading re-applies (``transform.py``)."""
