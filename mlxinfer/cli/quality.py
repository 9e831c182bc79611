"""``mlxinfer perplexity``: a thin shell over :func:`mlxinfer.quality.perplexity.perplexity`,
printing one comparison table (a row per model) or JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from ..errors import QualityError
from .options import _errors_to_click, _log


@click.command()
@click.option(
    "--model",
    "-m",
    "models",
    multiple=True,
    required=True,
    help="A model to score (directory, Hub id or .gguf); repeat for a comparison table.",
)
@click.option("--reference", default=None, help="Compare each model with this one (KLD, top-1).")
@click.option(
    "--text",
    "text_file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="UTF-8 text to score, its first --chunks [default: the evaluation corpus shipped in "
    "mlxinfer/quant/texts: prose in several languages, code, maths, tool-call JSON, and chats "
    "through the model's chat template; --chunks spread over all of it].",
)
@click.option("--ctx", default=512, show_default=True, type=click.IntRange(min=4))
@click.option(
    "--chunks",
    default=None,
    type=click.IntRange(min=1),
    help="At most this many chunks of --ctx tokens [default: 16, about a minute for a 135M model "
    "on 2 cores].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_errors_to_click
def perplexity(models, reference, text_file, ctx, chunks, as_json):
    """Perplexity of each model and, against --reference, KL divergence and top-1 agreement,
    on the same tokens (llama.cpp's llama-perplexity protocol: the second half of each chunk)."""
    from ..quality.perplexity import DEFAULT_CHUNKS
    from ..quality.perplexity import perplexity as run

    text = _read_text(text_file) if text_file else None
    report = run(
        list(models),
        reference,
        text=text,
        ctx=ctx,
        chunks=DEFAULT_CHUNKS if chunks is None else chunks,
        log=_log,
    )
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(report), indent=2))
        return
    scored = report.models[0].tokens
    _log(f"{scored} tokens scored: {report.chunks} chunks of {report.ctx}, the second half of each")
    click.echo(table(report))


COLUMNS = (
    "model",
    "MB",
    "bpw",
    "PPL",
    "ΔPPL %",
    "KLD",
    "KLD med",
    "KLD p90",
    "KLD p99",
    "KLD max",
    "top-1 %",
    "RMS Δp %",
)


def table(report) -> str:
    """One row per model (the reference first, marked), columns aligned."""
    rows = []
    if report.reference is not None:
        rows.append(_row(report.reference, " (reference)"))
    rows += [_row(s) for s in report.models]
    if report.reference is None:  # no comparison: only model, size and perplexity
        rows = [r[:4] for r in rows]
    header = list(COLUMNS[: len(rows[0])])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [header, *rows]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in lines
    )


def _row(s, mark: str = "") -> list[str]:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    row = [
        s.model + mark,
        f"{s.bytes / 1e6:.1f}",
        f"{s.bits_per_weight:.2f}",
        f"{s.ppl:.4f} ± {s.ppl_se:.4f}",
        num(s.delta_ppl_pct, "+.2f"),
        "-" if s.kld is None else f"{s.kld:.4f} ± {s.kld_se:.4f}",
        num(s.kld_median, ".4f"),
        num(s.kld_p90, ".4f"),
        num(s.kld_p99, ".4f"),
        num(s.kld_max, ".4f"),
        "-" if s.top1_pct is None else f"{s.top1_pct:.2f} ± {s.top1_se_pct:.2f}",
        num(s.rms_dp_pct, ".3f"),
    ]
    return row


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise QualityError(
            f"{path}: expected UTF-8 text, found byte 0x{e.object[e.start]:02x} at offset {e.start}"
        ) from None
