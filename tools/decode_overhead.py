"""Where a decode token's time goes in Python: graph building, evaluation wait, sampling,
detokenizer, stop matching, and the batching engine's per-step bookkeeping.

    python tools/decode_overhead.py [MODEL] [--tokens 64] [--rounds 5] [--batch B] [--profile]
    python tools/decode_overhead.py [MODEL] --compare OTHER_CHECKOUT [--rounds 5]

MODEL: a checkpoint or GGUF (default: the test suite's SmolLM2-135M GGUF). Each round runs
``generate_step`` (the bare token loop) and ``stream_generate`` (the loop, the detokenizer and
stop matching) over the same prompt; with ``--batch B`` the batching engine too, B greedy
requests at once. Figures are per decode token (the engine's: per step and per token), the
minimum and the median over the rounds, in milliseconds:

- ``build``: from the decode step's forward call to its ``mx.async_eval`` (the Python that
  builds the graph: the model's forward, the sampler, the log-probs); ``forward`` and
  ``sampler`` are its parts;
- ``wait``: the rest of the loop's step, almost all of it ``.item()`` waiting for the token;
- ``detok``, ``stop``: the streaming detokenizer and the stop-string matcher;
- ``other``: ``stream_generate``'s remaining per-token work (results, stats, the generators);
- engine (its plain steps go ahead, ``batch/ahead.py``: step n + 1 queued before step n's
  tokens are read): ``step`` (one step's period at the full batch), ``build`` (from the step's
  start to its ``mx.async_eval``: the rows' views, the forward, sampling), ``forward`` and
  ``sample`` (``sample_rows``) its parts, ``submit`` (the ``mx.async_eval``: MLX's submission,
  which waits while ten tasks are in flight, so mostly the step before still running),
  ``land`` (step n's tokens read and handed to the rows' queues, retiring), and
  ``bookkeeping``: the rest of a scheduler turn (admission, prefill checks, counters).

Nothing in the package changes for this: the probes wrap functions for the run (the model's
class ``__call__``, ``mx.async_eval``/``mx.eval``, the detokenizer's and stop matcher's
methods, the engine's decode methods) and put them back. ``--profile`` adds a cProfile of
``generate_step`` (top functions by own time) as a cross-check. ``--compare DIR`` runs this
tool's plain-loop measurement alternately in this checkout and in DIR (another checkout of the
package, e.g. ``git worktree add /tmp/base HEAD~1`` with the built kernels copied in), one
process per round, and prints each side's decode tok/s and build time with their ratios.

The CPU (lscpu's model name), its CPUs and the load average are printed beside the numbers.
"""

# ruff: noqa: I001  (mlxinfer before mlx: it loads the fast BLAS, which must come first)
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import mlxinfer
import mlx.core as mx

from mlxinfer.batch import ahead as ahead_mod
from mlxinfer.generation import loop, sampling
from mlxinfer.generation import request as request_mod
from mlxinfer.tokenization.detokenizer import StreamingDetokenizer

PROMPT = "The history of the Roman empire, told in short chapters. Chapter one:"
now = time.perf_counter


def machine() -> str:
    name = "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{name}, {os.cpu_count()} CPUs, load average {load}"


class Probes:
    """Timers wrapped around the decode path's parts for one run; ``restore`` puts them back."""

    def __init__(self, model) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)
        self.step_start: float | None = None
        self._saved: list[tuple[object, str, object]] = []
        self._engine_step: float | None = None
        self._engine_queue = False  # inside the engine's Ahead._queue
        self._engine_thread: int | None = None
        probe = self

        def patch(owner, name, make):
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, make(original))

        def forward(original):
            def timed(model_self, inputs, *args, **kwargs):
                decoding = inputs.ndim == 2 and inputs.shape[1] == 1
                t = now()
                if decoding and threading.current_thread() is threading.main_thread():
                    probe.step_start = t
                out = original(model_self, inputs, *args, **kwargs)
                if decoding:
                    probe.times["forward"].append(now() - t)
                return out

            return timed

        def async_eval(original):
            def timed(*args):
                t = now()
                if probe._engine_queue and threading.get_ident() == probe._engine_thread:
                    probe.times["e_build"].append(t - probe._engine_step)
                    out = original(*args)
                    probe.times["e_submit"].append(now() - t)
                    return out
                if probe.step_start is not None:
                    probe.times["build"].append(t - probe.step_start)
                    probe.step_start = None
                return original(*args)

            return timed

        def queue(original):  # Ahead._queue: one step built and queued
            def timed(ahead, go_on, ready, before):
                t = now()
                if probe._engine_step is not None:
                    probe.times["e_period"].append(t - probe._engine_step)
                    probe.times["e_rows"].append(len(go_on) + len(ready))
                probe._engine_step, probe._engine_queue = t, True
                probe._engine_thread = threading.get_ident()
                try:
                    return original(ahead, go_on, ready, before)
                finally:
                    probe._engine_queue = False
                    probe.times["e_queue"].append(now() - t)

            return timed

        def sample_rows(original):
            def timed(*args):
                t = now()
                out = original(*args)
                probe.times["e_sample"].append(now() - t)
                return out

            return timed

        def make_sampler(original):
            def made(*args, **kwargs):
                inner = original(*args, **kwargs)

                def timed(logits):
                    t = now()
                    out = inner(logits)
                    probe.times["sampler"].append(now() - t)
                    return out

                timed.params = getattr(inner, "params", None)  # type: ignore[attr-defined]
                return timed

            return made

        def method(key):
            def wrap(original):
                def timed(*args, **kwargs):
                    t = now()
                    out = original(*args, **kwargs)
                    probe.times[key].append(now() - t)
                    return out

                return timed

            return wrap

        def step_gen(original):
            def timed(*args, **kwargs):
                steps = original(*args, **kwargs)
                try:
                    while True:
                        t = now()
                        try:
                            item = next(steps)
                        except StopIteration:
                            return
                        probe.times["step"].append(now() - t)
                        yield item
                finally:
                    steps.close()

            return timed

        patch(type(model), "__call__", forward)
        patch(mx, "async_eval", async_eval)
        patch(ahead_mod.Ahead, "_queue", queue)
        patch(ahead_mod.Ahead, "_land", method("e_land"))
        patch(ahead_mod, "sample_rows", sample_rows)
        patch(sampling, "make_sampler", make_sampler)
        patch(loop, "make_sampler", make_sampler)
        patch(StreamingDetokenizer, "add_token", method("detok"))
        patch(StreamingDetokenizer, "finalize", method("detok"))
        patch(request_mod.StopMatcher, "push", method("stop"))
        patch(loop, "generate_step", step_gen)

    def restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def take(self) -> dict[str, list[float]]:
        times, self.times = self.times, defaultdict(list)
        return times


def per_token(times: dict[str, list[float]], key: str, n: int) -> float:
    """Milliseconds per token of ``key``'s total over ``n`` tokens."""
    return sum(times.get(key, ())) / max(n, 1) * 1000


def run_loop(model, ids, n_tokens: int, probes: Probes) -> dict[str, float]:
    """The bare loop: ``generate_step``'s tokens, each ``next`` timed from the consumer's side."""
    probes.take()
    gen, n, total, skip = loop.generate_step(ids, model, max_tokens=n_tokens + 1), 0, 0.0, True
    t = now()
    for _ in gen:
        if skip:  # the first token includes the prefill
            skip, t = False, now()
            probes.take()
            continue
        n += 1
    total = now() - t
    times = probes.take()
    build = per_token(times, "build", n)
    out = {
        "total": total / n * 1000,
        "tok_s": n / total,
        "build": build,
        "forward": per_token(times, "forward", n),
        "sampler": per_token(times, "sampler", n),
    }
    out["wait"] = out["total"] - build
    return out


def run_graph(model, ids, reps: int = 200) -> dict[str, float]:
    """The forward's graph building alone, timed apart from any evaluation: one decode token's
    ``model(token, cache)`` built ``reps`` times over the same cache position (the cache's
    offsets put back each time, each graph evaluated outside the timer); min and median ms.
    The minimum is what the Python costs on an idle core, the least noisy figure here."""
    cache = model.make_cache()
    mx.eval(model(mx.array([ids]), cache))
    offsets = [getattr(c, "offset", None) for c in cache]
    token, times = mx.array([[ids[-1]]]), []
    for _ in range(reps):
        for c, o in zip(cache, offsets):
            if o is not None:
                c.offset = o
        t = now()
        y = model(token, cache)[:, -1, :]
        times.append(now() - t)
        mx.eval(y)
    return {"graph_min": min(times) * 1000, "graph_median": statistics.median(times) * 1000}


def run_stream(model, tokenizer, n_tokens: int, probes: Probes) -> dict[str, float]:
    """``stream_generate``: the loop with the detokenizer, stop strings and results."""
    probes.take()
    results = mlxinfer.stream_generate(
        model, tokenizer, PROMPT, max_tokens=n_tokens + 1, stop=["\n\n\n\n", "<|never|>"]
    )
    n, skip, t = 0, True, now()
    for r in results:
        if skip:
            skip, t = False, now()
            probes.take()
            continue
        if r.finish_reason == "stop":  # an EOS: this prompt should not meet one
            break
        n += 1
    total = now() - t
    times = probes.take()
    out = {
        "total": total / n * 1000,
        "tok_s": n / total,
        "build": per_token(times, "build", n),
        "step": per_token(times, "step", n),
        "detok": per_token(times, "detok", n),
        "stop": per_token(times, "stop", n),
    }
    out["wait"] = out["step"] - out["build"]
    out["other"] = out["total"] - out["step"] - out["detok"] - out["stop"]
    return out


def run_engine(model, tokenizer, n_tokens: int, batch: int, probes: Probes) -> dict[str, float]:
    """The batching engine: ``batch`` greedy requests at once; per step and per token."""
    from mlxinfer.batch import Engine

    ids = tokenizer.encode(PROMPT)
    with Engine(model) as engine:
        warm = engine.submit(ids, max_tokens=4)
        list(warm.steps())
        probes.take()
        probes._engine_step = None
        t = now()
        handles = [engine.submit(ids, max_tokens=n_tokens) for _ in range(batch)]
        tokens = sum(len(list(h.steps())) for h in handles)
        total = now() - t
    times = probes.take()
    full = [p for p, rows in zip(times["e_period"], times["e_rows"]) if rows == batch]
    steps = len(times["e_queue"])
    ms = 1000 / max(steps, 1)
    out = {
        "tok_s": tokens / total,
        "step": statistics.median(full) * 1000 if full else float("nan"),
        "build": sum(times["e_build"]) * ms,
        "forward": sum(times["forward"]) * ms,
        "sample": sum(times["e_sample"]) * ms,
        "submit": sum(times["e_submit"]) * ms,
        "land": sum(times["e_land"]) * ms,
    }
    # a turn: its queue, the step before's landing, and the rest (between one queue and the next)
    busy = [q + land for q, land in zip(times["e_queue"], times["e_land"])]
    gaps = [p - b for p, b in zip(times["e_period"], busy)]
    out["bookkeeping"] = statistics.median(gaps) * 1000 if gaps else float("nan")
    return out


def summary(rounds: list[dict[str, float]]) -> str:
    keys = rounds[0].keys()
    cells = []
    for k in keys:
        values = [r[k] for r in rounds]
        if k == "tok_s":
            cells.append(f"tok/s {max(values):.1f} (median {statistics.median(values):.1f})")
        else:
            cells.append(f"{k} {min(values):.3f} ({statistics.median(values):.3f})")
    return "; ".join(cells)


def profile(model, ids, n_tokens: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in loop.generate_step(ids, model, max_tokens=n_tokens):
        pass
    profiler.disable()
    print(f"cProfile of generate_step, {n_tokens} tokens (own time):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def measure(args) -> dict:
    model, tokenizer = mlxinfer.load(args.model)
    ids = tokenizer.encode(PROMPT)
    probes = Probes(model)
    result: dict[str, list] = {"loop": [], "stream": [], "engine": []}
    try:
        run_loop(model, ids, 8, probes)  # warm-up
        for _ in range(args.rounds):
            result["loop"].append(run_loop(model, ids, args.tokens, probes))
            result["stream"].append(run_stream(model, tokenizer, args.tokens, probes))
            if args.batch:
                result["engine"].append(
                    run_engine(model, tokenizer, args.tokens, args.batch, probes)
                )
    finally:
        probes.restore()
    for row in result["loop"]:  # without the probes' wrappers in the way
        row.update(run_graph(model, ids))
    if args.profile:
        profile(model, ids, args.tokens)
    return result


def compare(args) -> None:
    """This checkout against ``args.compare``, one process per round, alternating."""
    sides = {"this": str(Path(__file__).resolve().parents[1]), "other": args.compare}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else reversed(list(sides)):
            env = dict(os.environ, PYTHONPATH=sides[side])
            cmd = [sys.executable, __file__, args.model, "--rounds", "1", "--json"]
            cmd += ["--tokens", str(args.tokens)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[side].append(json.loads(out.stdout.splitlines()[-1])["loop"][0])
    print(machine())
    for side, path in sides.items():
        print(f"{side} ({path}): {summary(runs[side])}")
    print("this/other per round:")
    for key in ("tok_s", "build", "graph_min"):
        ratio = [a[key] / b[key] for a, b in zip(runs["this"], runs["other"])]
        print(
            f"  {key}: {' '.join(f'{x:.3f}' for x in ratio)} (median {statistics.median(ratio):.3f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compare", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.support import fixtures

        args.model = str(fixtures.smollm2_gguf_path())
    if args.compare:
        compare(args)
        return
    before = machine()
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.model}\nbefore: {before}\nafter:  {machine()}")
    print("ms per token, minimum (median) over rounds")
    print(f"generate_step:   {summary(result['loop'])}")
    print(f"stream_generate: {summary(result['stream'])}")
    if result["engine"]:
        print(f"engine, {args.batch} rows, ms per step: {summary(result['engine'])}")


if __name__ == "__main__":
    main()
