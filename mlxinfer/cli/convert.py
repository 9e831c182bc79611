"""``mlxinfer convert`` and ``mlxinfer verify``: thin shells over ``convert`` and ``verify``."""

from __future__ import annotations

import sys

import click

from .options import _errors_to_click, _log


@click.command()
@click.argument("src")
@click.option(
    "--output", "-o", "dst", required=True, help="Output directory (must not exist or be empty)."
)
@click.option(
    "--quantize",
    "-q",
    is_flag=True,
    help="Quantize Linear/Embedding weights (GGUF without --dtype: re-quantize only its K-quant "
    "tensors to --bits/--group-size).",
)
@click.option(
    "--bits", default=4, show_default=True, type=click.Choice(["2", "3", "4", "5", "6", "8"])
)
@click.option("--group-size", default=64, show_default=True, type=click.Choice(["32", "64", "128"]))
@click.option(
    "--rounding",
    default="minmax",
    show_default=True,
    type=click.Choice(["minmax", "mse"]),
    help="How -q sets each group's scale and bias: from its min and max, or fitted to the least "
    "squared error (same format; HF checkpoints).",
)
@click.option(
    "--dtype",
    default=None,
    type=click.Choice(["float16", "bfloat16", "float32"]),
    help="Float dtype of the output; a GGUF is dequantized to it [default: the checkpoint's; "
    "a GGUF keeps its own types].",
)
@_errors_to_click
def convert(src, dst, quantize, bits, group_size, rounding, dtype):
    """Convert a Hugging Face checkpoint (directory or repo id) or a GGUF file."""
    from ..loading.convert import convert as run_convert

    report = run_convert(
        src,
        dst,
        quantize=quantize,
        bits=int(bits),
        group_size=int(group_size),
        rounding=rounding,
        dtype=dtype,
        progress=True,
        log=_log,
    )
    _log(
        f"wrote {report['path']}: {report['parameters'] / 1e6:.1f}M parameters, "
        f"{report['bits_per_weight']:.2f} bits per weight, {report['bytes'] / 2**20:.1f} MiB on disk"
    )


@click.command()
@click.argument("model_dir", metavar="DIR")
@_errors_to_click
def verify(model_dir):
    """Check every file of a model directory against its manifest (size and SHA-256).

    Exit status: 0 every file matches; 1 a file is damaged or missing (each named), or DIR
    is not a model directory; 3 DIR has no manifest (converted before manifests, or by
    another tool), so there is nothing to check against.
    """
    from ..files.manifest import MANIFEST_NAME
    from ..files.manifest import verify as run_verify

    result = run_verify(model_dir)
    if not result.has_manifest:
        click.echo(
            f"{result.path}: no {MANIFEST_NAME} (converted before manifests, or by another "
            "tool); nothing to check against"
        )
        sys.exit(3)
    for problem in result.problems:
        click.echo(f"damaged: {problem}")
    for name in result.unlisted:
        click.echo(f"note: {result.path / name}: not in {MANIFEST_NAME} (added after conversion)")
    if result.problems:
        click.echo(f"{result.path}: {len(result.problems)} of {result.files} files damaged/missing")
        sys.exit(1)
    size = f"{result.bytes / 2**20:.1f} MiB"
    click.echo(f"{result.path}: OK ({result.files} files, {size}, sizes and SHA-256 match)")
