"""The model store's commands (mlxinfer/store): pull, list, show, rm, cp, ps, stop, and run
(pull if missing, then chat). Each maps its options onto the store's functions."""

from __future__ import annotations

import json
import sys
import time

import click

from .options import _errors_to_click, _log


def _progress():
    from ..platform.progress import Bars, quiet

    return Bars() if sys.stderr.isatty() else quiet


def _size(n) -> str:
    from ..loading.memory import size_text

    return size_text(n) if isinstance(n, (int, float)) else "-"


def _count(n) -> str:
    if not isinstance(n, int):
        return "-"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _age(t) -> str:
    if not isinstance(t, (int, float)):
        return "-"
    s = max(time.time() - t, 0)
    for unit, scale in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if s >= scale:
            return f"{int(s // scale)} {unit} ago"
    return "just now"


def _table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _recipe(bits, group_size, bpw) -> dict | None:
    if bits is None and group_size is None and bpw is None:
        return None  # the store's default: convert -q (the measured plan)
    if bpw is not None:
        return {"bpw": bpw}
    return {k: v for k, v in (("bits", bits), ("group_size", group_size)) if v is not None}


@click.command()
@click.argument("name")
@click.option("--revision", default=None, help="Branch, tag or commit [default: main].")
@click.option("--bits", type=int, default=None, help="Uniform quantization at these bits.")
@click.option("--group-size", type=int, default=None, help="Uniform quantization group size.")
@click.option("--bpw", type=float, default=None, help="A measured plan at this size (bits/weight).")
@click.option("--keep-source", is_flag=True, help="Keep the downloaded files after converting.")
@_errors_to_click
def pull(name, revision, bits, group_size, bpw, keep_source):
    """Pull REPO[:VARIANT] from the Hugging Face Hub into the store (converted with -q; a GGUF
    repo's named quant, e.g. :Q4_K_M, as it is; an MLX-format repo as it is)."""
    from .. import store

    progress = _progress()
    try:
        record = store.pull(
            name,
            progress,
            revision=revision,
            recipe=_recipe(bits, group_size, bpw),
            keep_source=keep_source,
            log=_log,
        )
    finally:
        getattr(progress, "close", lambda: None)()
    click.echo(f"{record['status']}: {record['name']} ({record['commit'][:12]}) {record['path']}")


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON array.")
@click.option("--store-only", is_flag=True, help="Leave out other apps' models.")
@_errors_to_click
def list_models(as_json, store_only):
    """The store's models, and those other apps downloaded that mlxinfer runs in place."""
    from .. import store

    found = store.entries(others=not store_only)
    if as_json:
        click.echo(json.dumps(found, indent=1))
        return
    rows = [["NAME", "FAMILY", "PARAMS", "BPW", "CONTEXT", "SIZE", "SOURCE", "AGE"]]
    for e in found:
        bpw = e.get("bits_per_weight")
        rows.append([e["name"], e.get("family") or "-", _count(e.get("parameters")),
                     f"{bpw:.2f}" if bpw else "-", str(e.get("context_length") or "-"),
                     _size(e.get("bytes")), e["source"], _age(e.get("modified"))])  # fmt: skip
    _table(rows)


@click.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.option("--verify", "check", is_flag=True, help="Hash every file against the manifest.")
@_errors_to_click
def show(name, as_json, check):
    """What a stored model is: architecture, context length, quantization, capabilities, source,
    and whether it fits this machine."""
    from .. import store

    info = store.show(name, check=check)
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    fits = info.get("fits")
    lines = [
        ("name", info["name"]),
        ("path", info["path"]),
        ("architecture", info.get("architecture")),
        ("context length", info.get("context_length")),
        ("parameters", info.get("parameters")),
        ("bits per weight", info.get("bits_per_weight")),
        *((f"quantization {kind}", text) for kind, text in info["quantization"].items()),
        ("capabilities", ", ".join(info["capabilities"])),
        ("chat template", "yes" if info.get("chat_template") else "none"),
        ("license", info.get("license")),
        ("source", f"{info.get('repo')}@{info.get('commit')}" if info.get("repo") else None),
        ("recipe", json.dumps(info.get("recipe")) if info.get("recipe") else None),
        ("size", _size(info.get("bytes"))),
        ("verify", info.get("verify")),
        ("fits this machine", "unknown" if fits is None else "yes" if fits else "no"),
        ("fits up to context", info.get("fits_context")),
    ]
    for key, value in lines:
        click.echo(f"{key}: {value if value is not None else '-'}")


@click.command()
@click.argument("names", nargs=-1, required=True)
@click.option("--force", is_flag=True, help="Remove it even if the running server holds it.")
@_errors_to_click
def rm(names, force):
    """Remove models from the store (nothing outside it)."""
    from .. import store

    for name in names:
        click.echo(f"removed {name} ({store.remove(name, force=force)})")


@click.command()
@click.argument("src")
@click.argument("dst")
@_errors_to_click
def cp(src, dst):
    """Give the stored model SRC another name DST (its files shared)."""
    from .. import store

    click.echo(f"copied {src} to {dst} ({store.copy(src, dst)})")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON array.")
@_errors_to_click
def ps(as_json):
    """The models the running server holds (MLXINFER_HOST, else the one serve recorded)."""
    from .. import store

    models = store.running_models()
    if models is None:
        raise click.ClickException("no running server (MLXINFER_HOST unset, none recorded)")
    if as_json:
        click.echo(json.dumps(models, indent=1))
        return
    rows = [["NAME", "SIZE", "CONTEXT", "UNTIL"]]
    for m in models:
        rows.append([str(m.get("name") or m.get("model")), _size(m.get("size")),
                     str(m.get("context_length") or "-"), str(m.get("expires_at") or "-")])  # fmt: skip
    _table(rows)


@click.command()
@click.argument("name")
@_errors_to_click
def stop(name):
    """Unload NAME from the running server now."""
    from .. import store

    store.stop_model(name)
    click.echo(f"stopped {name}")


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("name")
@click.pass_context
@_errors_to_click
def run(ctx, name):
    """Chat with NAME, pulling it into the store first if it is not there (a local path or a
    stored name is used as it is). Takes chat's options after the name."""
    from pathlib import Path

    from .. import store
    from ..loading.loader import store_path
    from .generate import chat

    stored = store_path(name)
    if not Path(name).expanduser().exists() and not (
        stored is not None and (stored / "config.json").is_file()
    ):
        progress = _progress()
        try:
            store.pull(name, progress, log=_log)
        finally:
            getattr(progress, "close", lambda: None)()
    with chat.make_context("run", ["-m", name, *ctx.args], parent=ctx) as sub:
        chat.invoke(sub)


COMMANDS = (pull, list_models, show, rm, cp, ps, stop, run)
