"""Training on the machine at hand: ``mtp.py`` (``mlxinfer train-mtp``) gives a model that ships
no multi-token-prediction head one of its own, by self-distillation."""
