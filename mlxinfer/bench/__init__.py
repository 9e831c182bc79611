"""``mlxinfer bench``: prefill, decode, TTFT and memory per prompt length, llama-bench style.

Definitions are mlx-lm's own (``mlx_lm.generate.stream_generate``, which its
``mlx_lm.benchmark`` reports), so that mlxinfer / mlx-lm ratios compare like
with like:

- TTFT (time to first token): from the call into the token generator to the
  first token received — prefill of the whole prompt plus the first sampled
  token;
- prefill tok/s = p / TTFT, for a prompt of p tokens;
- decode tok/s = n / (t_last − t_first) for n generated tokens: all n tokens
  over the time after the first one arrived (mlx-lm's ``generation_tps`` at
  its last step; the n − 1 intervals make it n / (n − 1) above the per-step
  rate);
- peak memory = ``mx.get_peak_memory()``, reset before each run; it includes
  the resident weights, as mlx-lm's does (its benchmark never resets it, so
  its peak also covers loading and its warm-up run).

Each run: p seeded random token ids (no tokenizer in the timed path), greedy,
EOS ignored, exactly n tokens from :func:`mlxinfer.generation.generate_step`
with a fresh cache. One warm-up run per prompt length, then ``reps`` timed runs.

mlx-lm is never imported: ``--compare mlx-lm`` runs ``python -m
mlx_lm.benchmark`` in a child process (on the same BLAS, via ``LD_PRELOAD``)
and parses its ``Trial`` lines. Each engine keeps its own defaults, e.g. its
prefill chunk (mlxinfer 512 tokens, mlx-lm's benchmark 2048), unless
``--prefill-step-size`` sets one for both.
"""

from .bandwidth import comparison_notes, environment, measure_bandwidth, roofline
from .common import ENGINES, METRICS, BenchError
from .peer import child_env, mlx_lm_command, parse_trials, require_mlx_lm, run_mlx_lm
from .runs import parse_count, parse_lengths, prompt_ids, run_benchmark, summarize, time_run

__all__ = [
    "ENGINES",
    "METRICS",
    "BenchError",
    "child_env",
    "comparison_notes",
    "environment",
    "measure_bandwidth",
    "mlx_lm_command",
    "parse_count",
    "parse_lengths",
    "parse_trials",
    "prompt_ids",
    "require_mlx_lm",
    "roofline",
    "run_benchmark",
    "run_mlx_lm",
    "summarize",
    "time_run",
]
