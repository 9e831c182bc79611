"""One rank of the distributed tests (tests/distributed/test_distributed.py starts two of these).

``python distributed_rank.py MODEL_DIR MODE IDS N OUT``: loads MODEL_DIR with
``distributed=MODE``, decodes N greedy tokens after the comma-separated prompt IDS, and writes
{"tokens": [...], "logprobs": [[...], ...], "weight_bytes": int} to OUT.rank<r> as JSON.
"""

from __future__ import annotations

import json
import os
import sys

import mlxinfer
from mlxinfer.generation import generate_step


def main() -> None:
    model_dir, mode, ids, n, out = sys.argv[1:6]
    model, _ = mlxinfer.load(model_dir, distributed=mode, log=lambda m: print(m, file=sys.stderr))
    prompt = [int(i) for i in ids.split(",")]
    tokens, logprobs = [], []
    for token, lp in generate_step(prompt, model, max_tokens=int(n)):
        tokens.append(token)
        logprobs.append(lp.tolist())
    result = {"tokens": tokens, "logprobs": logprobs, "weight_bytes": model.weight_bytes}
    with open(f"{out}.rank{os.environ['MLX_RANK']}", "w") as f:
        json.dump(result, f)


def finish(out: str, result: dict) -> None:
    """Write this rank's ``result`` to OUT.rank<r> and end the process at once (``os._exit``:
    a ring group's teardown could wait on a peer that already left)."""
    with open(f"{out}.rank{os.environ['MLX_RANK']}", "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
