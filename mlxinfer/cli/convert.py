"""``mlxinfer convert`` and ``mlxinfer verify``: thin shells over ``convert`` and ``verify``."""

from __future__ import annotations

import sys

import click

from .options import _errors_to_click, _log


def _size(value: str | None) -> int | None:
    """``--max-bytes``: a plain integer or one with a K/M/G suffix (powers of 1000)."""
    if value is None:
        return None
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = value.strip().upper().removesuffix("B")
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        size = float(number) * scale
    except ValueError:
        size = -1
    if not 0 < size < 2**63:  # also NaN and inf
        raise click.BadParameter(f"expected bytes such as 90M or 90000000, found {value!r}")
    return int(size)


@click.command()
@click.argument("src")
@click.option(
    "--output", "-o", "dst", required=True, help="Output directory (must not exist or be empty)."
)
@click.option(
    "--quantize",
    "-q",
    is_flag=True,
    help="Quantize: alone, the measured mixed plan at 4.5 bits per weight (like --bpw 4.5); with "
    "--bits/--group-size, every layer at those settings. A GGUF without --dtype: re-quantize only "
    "its K-quant tensors.",
)
@click.option(
    "--bits",
    default=None,
    type=click.Choice(["2", "3", "4", "5", "6", "8"]),
    help="Uniform bits for every layer [4 when only --group-size is given].",
)
@click.option(
    "--group-size",
    default=None,
    type=click.Choice(["32", "64", "128"]),
    help="Uniform group size [64 when only --bits is given].",
)
@click.option(
    "--bpw",
    type=float,
    default=None,
    help="Mixed plan: bits per weight of the weight files; each tensor's bits and group size "
    "chosen from measured KL divergence on calibration tokens.",
)
@click.option(
    "--max-bytes",
    default=None,
    help="Mixed plan within this many bytes of weight files (90M, 1.2G).",
)
@click.option(
    "--recipe",
    default=None,
    type=click.Choice(["q4_k_m", "q3_k_m"]),
    help="A named mixed recipe shaped like llama.cpp's (head at 6 bits, tied or not).",
)
@click.option(
    "--tensor-bits",
    multiple=True,
    metavar="PATTERN=BITS[:GROUP]",
    help="Force matching tensors (a regex on module paths) to a setting in a plan; repeatable.",
)
@click.option(
    "--calibration",
    type=click.Path(dir_okay=False),
    default=None,
    help="UTF-8 text to calibrate on [default: the calibration corpus shipped with mlxinfer].",
)
@click.option(
    "--imatrix",
    type=click.Path(dir_okay=False),
    default=None,
    help="Importance file (ours, or llama.cpp's imatrix .gguf/.dat) instead of the calibration pass.",
)
@click.option(
    "--plan-from",
    type=click.Path(dir_okay=False),
    default=None,
    help="A previous conversion's quantization-plan.json of the same model: reuse its measured "
    "costs to plan another size without measuring again.",
)
@click.option(
    "--rounding",
    default=None,
    type=click.Choice(["minmax", "mse", "gptq"]),
    help="How weights are rounded: each group's scale and bias from its min and max; fitted to "
    "the least squared error, importance-weighted in a plan; or GPTQ (a plan only): columns in "
    "order, each one's error compensated in the later ones through the layer's input "
    "covariance. Same format for all three [default: mse for a plan, minmax for "
    "--bits/--group-size].",
)
@click.option(
    "--dtype",
    default=None,
    type=click.Choice(["float16", "bfloat16", "float32"]),
    help="Float dtype of the output; a GGUF is dequantized to it [default: the checkpoint's; "
    "a GGUF keeps its own types].",
)
@_errors_to_click
def convert(
    src,
    dst,
    quantize,
    bits,
    group_size,
    bpw,
    max_bytes,
    recipe,
    tensor_bits,
    calibration,
    imatrix,
    plan_from,
    rounding,
    dtype,
):
    """Convert a Hugging Face checkpoint (directory or repo id) or a GGUF file."""
    from ..loading.convert import convert as run_convert

    report = run_convert(
        src,
        dst,
        quantize=quantize,
        bits=int(bits) if bits else None,
        group_size=int(group_size) if group_size else None,
        bpw=bpw,
        max_bytes=_size(max_bytes),
        recipe=recipe,
        tensor_bits=tensor_bits,
        calibration=calibration,
        imatrix=imatrix,
        plan_from=plan_from,
        rounding=rounding,
        dtype=dtype,
        progress=True,
        log=_log,
    )
    _log(
        f"wrote {report['path']}: {report['parameters'] / 1e6:.1f}M parameters, "
        f"{report['bits_per_weight']:.2f} bits per weight, {report['bytes'] / 2**20:.1f} MiB on disk"
    )
    if "plan" in report:
        predicted = report["predicted_kl"]
        _log(
            f"plan: {report['plan']}; KL divergence on the probe tokens "
            + (f"predicted {predicted:.4f}, " if predicted is not None else "")
            + f"measured {report['measured_kl']:.4f} ({report['calibration_tokens']} calibration "
            f"tokens, {report['plan_seconds']:.0f} s)"
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
