"""``mlxinfer bench`` output: markdown tables, the JSON file and the plot.

Files are written to a temporary file in the target directory and renamed
into place, so a reader never sees half a file.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

from ..errors import MlxInferError
from ..files.atomic import writing_file
from .common import ENGINES

# metric -> (column title, unit scale, format)
COLUMNS = {
    "prefill_tps": ("prefill tok/s ↑", 1.0, "{:.1f}"),
    "decode_tps": ("decode tok/s ↑", 1.0, "{:.1f}"),
    "ttft_s": ("TTFT ms ↓", 1000.0, "{:.1f}"),
    "peak_memory_gb": ("peak MB ↓", 1000.0, "{:.1f}"),
}


def _cell(summary: dict, metric: str) -> str:
    """``median (min–max)``."""
    _, scale, fmt = COLUMNS[metric]
    lo, hi = summary["spread"][metric]
    return f"{fmt.format(summary['median'][metric] * scale)} ({fmt.format(lo * scale)}–{fmt.format(hi * scale)})"


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def tables(result: dict) -> str:
    """The results as markdown: per engine and prompt length, then ratios, then the decode roofline."""
    env, s = result["environment"], result["settings"]
    kv = f", {s['kv_bits']}-bit KV cache" if s["kv_bits"] else ""
    kv += f", prefill chunks of {s['prefill_step']} tokens" if s.get("prefill_step") else ""
    runs = f"{s['reps']} run{'s' * (s['reps'] > 1)}"
    caption = (
        f"{result['model']} — MLX {env['mlx']} on {env['device']}, {env['blas']}; {s['max_tokens']} "
        f"generated tokens{kv}, greedy; median (min–max) of {runs} after a warm-up; "
        f"{env.get('cpu', 'CPU')} × {env['cpus']}, 1-min load average {env['load_average_1min'] or 0:.1f}"
    )
    lines = [
        caption,
        "",
        "| engine | prompt | " + " | ".join(c[0] for c in COLUMNS.values()) + " |",
        "|---|---:|" + "---:|" * len(COLUMNS),
    ]
    for entry in result["results"]:
        for engine, summary in entry["engines"].items():
            lines.append(
                f"| {engine} | {entry['prompt_tokens']} | "
                + " | ".join(_cell(summary, m) for m in COLUMNS)
                + " |"
            )
    if s["compare"]:
        lines += [
            "",
            f"mlxinfer / {s['compare']} (medians):",
            "",
            "| prompt | " + " | ".join(c[0] for c in COLUMNS.values()) + " |",
            "|---:|" + "---:|" * len(COLUMNS),
        ]
        for entry in result["results"]:
            lines.append(
                f"| {entry['prompt_tokens']} | "
                + " | ".join(f"{entry['ratios'][m]:.2f}×" for m in COLUMNS)
                + " |"
            )
    bw = result["bandwidth"]
    caption = (
        f"decode roofline (mlxinfer): memory bandwidth {bw['gb_per_s']:.1f} GB/s ({bw['probe']}); "
        "bytes per token = weights read + KV cache at the mean decode context"
    )
    lines += [
        "",
        caption,
        "",
        "| prompt | mean context | weights | KV cache | bytes/token | limit tok/s | decode tok/s | reached |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in result["results"]:
        r = entry["roofline"]
        lines.append(
            f"| {entry['prompt_tokens']} | {r['mean_context']:g} | {_size(r['weight_bytes'])} | "
            f"{_size(r['kv_bytes'])} | {_size(r['bytes_per_token'])} | {r['limit_tps']:.1f} | "
            f"{r['decode_tps']:.1f} | {r['fraction']:.0%} |"
        )
    if result["notes"]:
        lines += [""] + [f"Note: {note}" for note in result["notes"]]
    return "\n".join(lines)


def check_writable(path: str | os.PathLike, option: str) -> Path:
    """``path`` as a Path whose directory exists; MlxInferError naming ``option`` otherwise."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise MlxInferError(f"{option}: directory '{parent}' does not exist (for '{path}')")
    if path.is_dir():
        raise MlxInferError(f"{option}: expected a file path, found the directory '{path}'")
    return path


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, fsync, then rename it onto ``path``."""
    with writing_file(path) as tmp:
        write(tmp)


def write_json(result: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    _write_atomic(path, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))
    return path


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise MlxInferError("--plot needs matplotlib: pip install 'mlxinfer[bench]'")


def write_plot(result: dict, path: str | os.PathLike) -> Path:
    """Two panels, prefill and decode tok/s against prompt length (log2 axis): one line per engine,
    the median with its min–max as error bars."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, metric, title in zip(axes, ("prefill_tps", "decode_tps"), ("prefill", "decode")):
        for engine in ENGINES:
            entries = [e for e in result["results"] if engine in e["engines"]]
            if not entries:
                continue
            xs = [e["prompt_tokens"] for e in entries]
            ys = [e["engines"][engine]["median"][metric] for e in entries]
            lo = [y - e["engines"][engine]["spread"][metric][0] for y, e in zip(ys, entries)]
            hi = [e["engines"][engine]["spread"][metric][1] - y for y, e in zip(ys, entries)]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=engine)
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            result["settings"]["prompt_tokens"],
            [str(x) for x in result["settings"]["prompt_tokens"]],
        )
        ax.minorticks_off()
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("tok/s")
        ax.set_title(f"{title} (n = {result['settings']['max_tokens']})")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(Path(result["model"]).name)
    path = Path(path)
    try:
        _write_atomic(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
    return path
