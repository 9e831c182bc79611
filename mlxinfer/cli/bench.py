"""``mlxinfer bench``: prefill, decode, time to first token and peak memory per prompt length,
or the batching engine's aggregate decode per batch size; optionally beside mlx-lm."""

from __future__ import annotations

import os

import click

from .options import _batch_sizes, _errors_to_click, _load, _log, model_option


@click.command()
@model_option
@click.option(
    "--prompt-tokens",
    "-p",
    default="128,512,2048",
    show_default=True,
    metavar="P[,P...]",
    help="Prompt lengths, comma-separated (seeded random token ids).",
)
@click.option(
    "--max-tokens",
    "-n",
    default="128",
    show_default=True,
    metavar="N",
    help="Tokens generated per run (at least 2).",
)
@click.option(
    "--reps",
    default="3",
    show_default=True,
    metavar="R",
    help="Timed runs per prompt length, after one warm-up.",
)
@click.option(
    "--kv-bits", default=None, type=click.Choice(["4", "8"]), help="Quantize mlxinfer's KV cache."
)
@click.option(
    "--prefill-step-size",
    default=None,
    type=click.IntRange(1),
    help="Prompt tokens per prefill chunk, for both engines [default: each engine's own: "
    "mlxinfer 512, mlx-lm 2048].",
)
@click.option(
    "--compare",
    default=None,
    type=click.Choice(["mlx-lm"]),
    help="Also run mlx-lm's own benchmark (a child process) and print mlxinfer / mlx-lm.",
)
@click.option(
    "--plot",
    default=None,
    metavar="PATH",
    help="Write prefill and decode tok/s against prompt length (PNG).",
)
@click.option(
    "--json",
    "json_path",
    default=None,
    metavar="PATH",
    help="Write every run, medians, ratios and the roofline.",
)
@click.option(
    "--batch",
    "batch_sizes",
    default=None,
    metavar="B[,B...]",
    callback=lambda ctx, param, v: None if v is None else _batch_sizes(v),
    help="Benchmark the batching engine at these batch sizes (aggregate decode tok/s) "
    "with one prompt length.",
)
@click.option(
    "--replan",
    is_flag=True,
    help="Time the CPU backend's decode plans again (MLXINFER_CPU_PLANS=replan) and cache "
    "the new choice, e.g. after the first run timed them on a busy machine.",
)
@_errors_to_click
def bench(
    model,
    prompt_tokens,
    max_tokens,
    reps,
    kv_bits,
    prefill_step_size,
    compare,
    plot,
    json_path,
    batch_sizes,
    replan,
):
    """Benchmark prefill, decode, TTFT and peak memory per prompt length.

    Progress goes to stderr, the tables alone to stdout.
    """
    from .. import bench as b
    from ..bench import report
    from ..loading.default_model import default_model_path
    from ..loading.loader import resolve_model_path

    lengths = b.parse_lengths(prompt_tokens, "-p/--prompt-tokens")
    max_tokens = b.parse_count(max_tokens, "-n/--max-tokens", 2)
    reps = b.parse_count(reps, "--reps", 1)
    # Every check that can fail runs before the (long) measurement.
    if compare:
        b.require_mlx_lm()
    if plot:
        report.require_matplotlib()
        plot = report.check_writable(plot, "--plot")
    if json_path:
        json_path = report.check_writable(json_path, "--json")
    model_dir = default_model_path(log=_log) if model is None else resolve_model_path(model)
    if model_dir.is_file():  # a .gguf: its import (made once), which mlx-lm can read too
        from ..loading.gguf_files import model_dir_for

        model_dir = model_dir_for(model_dir, log=_log)
    if replan:  # read once, by the backend's plan choice during this load
        os.environ["MLXINFER_CPU_PLANS"] = "replan"
    llm, _ = _load(str(model_dir), verbose=True)
    if batch_sizes is not None:
        return _bench_batch(
            llm,
            model_dir,
            batch_sizes,
            lengths,
            max_tokens,
            reps,
            compare,
            json_path,
            int(kv_bits) if kv_bits else None,
        )
    result = b.run_benchmark(
        llm,
        model_dir,
        lengths,
        max_tokens=max_tokens,
        reps=reps,
        kv_bits=int(kv_bits) if kv_bits else None,
        prefill_step=prefill_step_size,
        compare=compare,
        log=_log,
    )
    click.echo(report.tables(result))
    if json_path:
        _log(f"wrote {report.write_json(result, json_path)}")
    if plot:
        _log(f"wrote {report.write_plot(result, plot)}")


def _bench_batch(
    llm, model_dir, batch_sizes, lengths, max_tokens, reps, compare, json_path, kv_bits=None
):
    from ..bench import batch, report

    if len(lengths) != 1:
        raise click.UsageError("--batch takes one prompt length (-p P)")
    result = batch.run_batch_benchmark(
        llm, model_dir, batch_sizes, lengths[0], max_tokens, reps, compare, _log, kv_bits
    )
    click.echo(batch.batch_tables(result))
    if json_path:
        _log(f"wrote {report.write_json(result, json_path)}")
