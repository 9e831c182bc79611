"""The quantization record in config.json: which one counts, what each layer's entry means, and
what MLX can store (every MLX community format: mlx-lm's uniform and mixed recipes, its
``--q-mode`` float formats, DWQ/AWQ/GPTQ outputs, which are affine records).

The record is MLX's, as mlx-lm writes and reads it (``mlx_lm/utils.py``)::

    {"group_size": 64, "bits": 4, "mode": "affine",          # the defaults
     "model.layers.0.mlp.down_proj": {"group_size": null, "bits": 6, "mode": "affine"},
     "lm_head": false}                                         # kept in float

- ``quantization`` wins over ``quantization_config`` (mlx-lm writes both, equal, for the Hub's
  model tree; its loader reads ``quantization`` first). ``quantization_config`` alone counts only
  as gpt-oss's ``quant_method: mxfp4`` (:data:`MXFP4`).
- A null or absent ``group_size``/``bits`` is the mode's default (mlx.nn's ``to_quantized``:
  :data:`MODES`); mlx-lm's mixed recipes write ``group_size: null`` when no group size is given.
- A layer's entry names its own settings; a key it leaves out is the record's default when the
  entry's mode is the record's, else that mode's default. ``false``: the layer stays in float.

Anything else is a one-line :class:`ConfigError` naming the key, the expected and the found
value, before MLX sees it.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

# mode -> (default group size, default bits, group sizes MLX stores, bits MLX stores). The
# defaults are mlx.nn's (_defaults_for_mode); each float mode has one (group, bits) pair.
MODES: dict[str, tuple[int, int, tuple[int, ...], tuple[int, ...]]] = {
    "affine": (64, 4, (32, 64, 128), (2, 3, 4, 5, 6, 8)),
    "mxfp4": (32, 4, (32,), (4,)),
    "nvfp4": (16, 4, (16,), (4,)),
    "mxfp8": (32, 8, (32,), (8,)),
}
SETTINGS = ("group_size", "bits", "mode")
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}


def quantization_record(
    config: dict[str, Any], source: str = "config.json"
) -> dict[str, Any] | None:
    """The record of how ``config``'s weights are quantized, checked (:func:`check_record`):
    ``quantization``, else an MXFP4 checkpoint's (``quantization_config`` with
    ``quant_method: mxfp4``: its layers with ``.scales`` are MLX ``mxfp4``), else None (float
    weights)."""
    if "quantization" in config:
        check_record(config["quantization"], source)
        return config["quantization"]
    theirs = config.get("quantization_config")
    if isinstance(theirs, dict) and theirs.get("quant_method") == "mxfp4":
        return dict(MXFP4)
    return None


def layer_settings(record: dict[str, Any], entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{group_size, bits, mode}`` for a layer: the record's defaults, or its ``entry``."""
    mode = record.get("mode", "affine")
    group_size, bits = record.get("group_size"), record.get("bits")
    if entry is not None:
        if entry.get("mode", mode) != mode:  # another mode: its own defaults, not the record's
            mode, group_size, bits = entry["mode"], None, None
        group_size = entry.get("group_size", group_size)
        bits = entry.get("bits", bits)
    default_group, default_bits, _, _ = MODES[mode]
    # null: the mode's default, as mlx.nn reads it (``group_size or default``)
    return {"group_size": group_size or default_group, "bits": bits or default_bits, "mode": mode}


def check_record(record: Any, source: str = "config.json") -> None:
    """A one-line ConfigError for a record MLX cannot load: a mode MLX lacks, bits or a group
    size the mode cannot store (affine: bits 2-6 or 8, group 32/64/128; mxfp4 32/4, nvfp4 16/4,
    mxfp8 32/8), a setting mlxinfer's layers do not take (nvfp4's ``global_scale``), or a layer
    entry that is neither an object nor true/false."""
    if not isinstance(record, dict):
        raise ConfigError(f"{source}: key 'quantization' must be an object, found {_short(record)}")
    entries = [("quantization", None)] + [
        (f"quantization.{k}", v) for k, v in record.items() if isinstance(v, dict)
    ]
    for key, value in record.items():
        if key not in SETTINGS and not isinstance(value, (dict, bool)):
            raise ConfigError(
                f"{source}: 'quantization.{key}' must be an object or false, found {_short(value)}"
            )
    for where, entry in entries:
        given = record if entry is None else entry
        for key in given if entry is not None else ():
            if key not in SETTINGS:
                raise ConfigError(
                    f"{source}: '{where}.{key}' is not supported (expected only "
                    f"group_size, bits and mode), found {_short(given[key])}"
                )
        mode = given.get("mode", record.get("mode", "affine"))
        if not isinstance(mode, str) or mode not in MODES:
            raise ConfigError(
                f"{source}: '{where}.mode' must be one of {', '.join(map(repr, MODES))}, "
                f"found {_short(mode)}"
            )
        _, _, groups, bits = MODES[mode]
        # Only the values given here: null is the mode's default, an absent one the record's
        # (checked with the record) or the mode's.
        for key, allowed in (("bits", bits), ("group_size", groups)):
            value = given.get(key)
            if value is not None and not (
                isinstance(value, int) and not isinstance(value, bool) and value in allowed
            ):
                raise ConfigError(
                    f"{source}: '{where}.{key}' must be {_one_of(allowed)} for mode "
                    f"'{mode}', found {_short(value)}"
                )


def _one_of(allowed: tuple[int, ...]) -> str:
    if len(allowed) == 1:
        return str(allowed[0])
    return ", ".join(map(str, allowed[:-1])) + f" or {allowed[-1]}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
