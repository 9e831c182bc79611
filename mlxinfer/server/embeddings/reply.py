"""The JSON ``/v1/embeddings`` sends back: OpenAI's list of ``embedding`` objects."""

from __future__ import annotations

import base64

from .request import EmbeddingsRequest


def reply(ask: EmbeddingsRequest, vectors, tokens: int) -> dict:
    """OpenAI's response: one ``embedding`` object per input, in order, with the usage."""
    import numpy as np

    array = np.asarray(vectors, dtype=np.float32)  # (N, D)
    if ask.encoding == "base64":
        rows = [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in array]
    else:
        rows = array.tolist()
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(rows)],
        "model": ask.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
