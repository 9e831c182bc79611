"""``mlxinfer embed``: a thin shell over :func:`mlxinfer.embeddings.embed`: the texts given as
arguments, or else each line of stdin, one vector per text, in order."""

from __future__ import annotations

import json
import sys

import click

from .options import _errors_to_click, _load


@click.command()
@click.argument("texts", nargs=-1)
@click.option(
    "--model",
    "-m",
    required=True,
    help="An embedding checkpoint (sentence-transformers layout): directory or Hub repo id.",
)
@click.option(
    "--pooling",
    type=click.Choice(["lasttoken", "mean", "cls"]),
    default=None,
    help="Pool the token states this way (normalised) [default: as the checkpoint's "
    "modules.json and 1_Pooling/config.json say].",
)
@click.option(
    "--dimensions",
    type=click.IntRange(min=1),
    default=None,
    help="Keep the leading dimensions of each vector, then normalise (Matryoshka models).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print {"model": ..., "embeddings": [[...], ...]} instead of a line of numbers per text.',
)
@click.option("--verbose", "-v", is_flag=True, help="Print the BLAS and kernels in use.")
@_errors_to_click
def embed(texts, model, pooling, dimensions, as_json, verbose):
    """Embed TEXTS (or, without any, each line of stdin) with an embedding model."""
    from ..embeddings import embed as run

    items = list(texts) if texts else sys.stdin.read().splitlines()
    if not items:
        raise click.UsageError("no text to embed: give TEXTS or lines on stdin")
    llm, tokenizer = _load(model, verbose)
    vectors = run(llm, tokenizer, items, pooling=pooling, dimensions=dimensions).tolist()
    if as_json:
        click.echo(json.dumps({"model": model, "embeddings": vectors}))
    else:
        for vector in vectors:
            click.echo(" ".join(f"{x:.9g}" for x in vector))  # 9 digits: float32 round-trips
