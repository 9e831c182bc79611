"""``--distributed`` on ``generate``, ``chat`` and ``serve``, and ``mlxinfer launch``
(docs/distributed.md).

A command declares the distributed options with ``@distributed_options`` and takes a
:class:`Setting`: where it runs. Without ``--distributed`` that is one process (the whole
model, stdout, ``input``). With it every rank runs the same command: the setting carries this
rank's ``load`` keywords (:func:`mlxinfer.distributed.load`), the engine's (``micro_batches``),
where the output goes (stdout on rank 0, a quiet writer on the others) and how a line is read
(rank 0's, on every rank); rank 0's prompt (``--prompt``, or its stdin), ``--batch`` file and a
shared seed reach every rank first. A rank ends with ``os._exit``: a ring group's teardown could
otherwise wait on a peer that died.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import click

from ..distributed.watchdog import DEFAULT_RANK_TIMEOUT
from .options import _errors_to_click, _log

MODES = ("pipeline", "tensor")
UNSUPPORTED = {  # the commands' options that do not run across ranks yet
    "models_dir": "--models-dir",
}


@dataclass
class Setting:
    """Where a command runs: one process (the default), or one rank of several.

    ``load``: more keywords for the load (``mlxinfer.distributed.load``'s; empty: the whole
    model); ``engine``: more for the batching engine (``micro_batches``); ``out``: where the
    output goes (None: stdout); ``ranks``: the ranks, or None."""

    load: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    out: TextIO | None = None
    ranks: Any = None

    def read_line(self, prompt: str) -> str:
        """``input(prompt)``; across ranks rank 0's line on every rank (the others read
        nothing), EOFError on every rank at rank 0's end of input."""
        if self.ranks is None:
            return input(prompt)
        from ..errors import DistributedError

        try:
            line = self.ranks.share_line(lambda: input(prompt))
        except DistributedError as e:
            raise click.ClickException(str(e)) from None
        if line is None:
            raise EOFError
        return line


def _rank_memory(ctx, param, value: str | None) -> str | list[int] | None:
    """``auto``, or a comma-separated list of byte counts (``--rank-memory``)."""
    from .limits import _size

    if value is None or value.strip() == "auto":
        return None if value is None else "auto"
    return [_size(ctx, param, part) for part in value.split(",")]


OPTIONS = [
    click.option(
        "--distributed",
        type=click.Choice(MODES),
        default=None,
        help="Run across the ranks of MLX's environment (mlxinfer launch, mlx.launch, or "
        "MLX_RANK + MLX_HOSTFILE): the layers split (pipeline) or the heads (tensor).",
    ),
    click.option(
        "--rank-memory",
        default=None,
        callback=_rank_memory,
        metavar="auto|SIZE[,SIZE...]",
        help="Pipeline: give each rank layers in proportion to its memory: 'auto' (what each "
        "machine can give now) or sizes (K/M/G; one per rank, e.g. 48G,96G). Default: "
        "the same number of layers each.",
    ),
    click.option(
        "--no-micro-batches",
        is_flag=True,
        help="Pipeline: the batching engine (--batch, serve) passes every decoding row "
        "through the ranks one after another, not in flights of rows, one at each rank.",
    ),
    click.option(
        "--rank-timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=DEFAULT_RANK_TIMEOUT,
        show_default=True,
        help="Seconds a step may wait on the other ranks before this rank gives up and exits.",
    ),
]


def distributed_options(run):
    """``--distributed``, ``--rank-memory``, ``--no-micro-batches`` and ``--rank-timeout`` on a
    command (``generate``, ``chat``, ``serve``), which takes a ``setting`` (:class:`Setting`)
    in their place. Across ranks every rank runs it (:func:`_run_rank`)."""

    @functools.wraps(run)
    def command(*args, distributed, rank_timeout, rank_memory, no_micro_batches, **kwargs):
        if distributed is None:
            if rank_memory is not None or no_micro_batches:
                flag = "--rank-memory" if rank_memory is not None else "--no-micro-batches"
                raise click.UsageError(f"{flag} is for --distributed pipeline")
            return run(*args, setting=Setting(), **kwargs)
        load = {"distributed": distributed, "rank_timeout": rank_timeout}
        if rank_memory is not None:
            load["rank_memory"] = rank_memory
        if kwargs.get("self_draft_layers") is not None:  # a pipeline's rank 0 drafts: its head
            load["head_on_first"] = True  # (where tensor falls back to the pipeline too)
        engine = {"micro_batches": False} if no_micro_batches else {}
        return _run_rank(run, Setting(load, engine), args, kwargs)

    for option in reversed(OPTIONS):
        command = option(command)
    return command


def _run_rank(run, setting: Setting, args, kwargs) -> None:
    """``run`` as one rank: rank 0's prompt, ``--batch`` file and seed on every rank, the
    output on rank 0 alone; every error reported, then ``os._exit``."""
    from ..batch.requests import EngineError
    from ..distributed import current
    from ..errors import DistributedError

    for key, flag in UNSUPPORTED.items():
        if kwargs.get(key):
            raise click.UsageError(f"{flag} does not run with --distributed yet")
    shared_dir = None
    try:
        setting.ranks = ranks = current(setting.load["rank_timeout"])
        if kwargs.get("batch_file"):  # rank 0's file, on every rank
            shared_dir = tempfile.mkdtemp(prefix="mlxinfer-batch-")
            kwargs["batch_file"] = _share_file(ranks, kwargs["batch_file"], shared_dir)
        elif "prompt" in kwargs:  # generate (chat shares its lines; serve's rank 0 feeds all)
            if kwargs["prompt"] is None:
                kwargs["prompt"] = sys.stdin.read() if ranks.first else ""
            kwargs["prompt"] = ranks.share_text(kwargs["prompt"])
        if kwargs.get("temperature") and kwargs.get("seed") is None:
            kwargs["seed"] = ranks.shared_seed()  # each rank's sampler draws the same numbers
    except DistributedError as e:
        raise click.ClickException(str(e)) from None
    quiet = None
    if not ranks.first:  # only rank 0 prints the output
        setting.out = quiet = open(os.devnull, "w")  # noqa: SIM115 (closed by os._exit)
    code = 0
    try:
        run(*args, setting=setting, **kwargs)
        if kwargs.get("verbose"):
            _log(ranks.summary())  # every rank's own line, on its stderr
    except click.ClickException as e:
        e.show()
        code = e.exit_code
    except click.exceptions.Exit as e:
        code = e.exit_code
    except EngineError as e:  # the batching engine stopped: a rank lost, say
        _log(f"Error: {e}")
        code = 1
    except BaseException:  # noqa: BLE001 (a rank must never hang its peers: report, then exit)
        traceback.print_exc()
        code = 1
    finally:
        if shared_dir is not None:
            shutil.rmtree(shared_dir, ignore_errors=True)
        for stream in (quiet, sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(code)


def _share_file(ranks, path: str, directory: str) -> str:
    """Rank 0's ``path`` (``--batch FILE``) on every rank: its text, shared and written to
    ``directory`` on the others (rank 0 keeps its own path: an unreadable file is its error,
    and the others read an empty copy)."""
    text = ""
    if ranks.first:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            text = ""
    text = ranks.share_text(text)
    if ranks.first:
        return path
    copy = Path(directory) / Path(path).name
    copy.write_text(text, encoding="utf-8")
    return str(copy)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "ranks", type=click.IntRange(1, 64), required=True, help="How many ranks.")
@click.option(
    "--hostfile",
    type=click.Path(dir_okay=False),
    default=None,
    help="A ring hostfile of n local ranks (JSON: one ['host:port'] per rank); "
    "default: 127.0.0.1 with free ports.",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Seconds the other ranks get to exit after one failed, before SIGKILL.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="End every rank after this many seconds (exit code 124).",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@_errors_to_click
def launch(ranks, hostfile, grace, timeout, command):
    """Run COMMAND as RANKS local ranks (ring backend on 127.0.0.1), e.g.
    ``mlxinfer launch -n 2 -- mlxinfer generate --distributed pipeline -p Hi``.

    Exits with the first failing rank's code, ending the others; ends every rank when
    interrupted.
    """
    from ..distributed.launch import launch as run_ranks

    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    sys.exit(run_ranks(command, ranks, hostfile=hostfile, grace=grace, timeout=timeout, log=_log))
