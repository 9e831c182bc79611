"""How good a model's weights are: perplexity and KL divergence against a reference on the same
tokens (perplexity.py), and the texts shipped to measure them on and to calibrate on (corpus.py, texts/)."""
