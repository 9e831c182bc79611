"""The ``mlxinfer`` command: the group and its commands, each a thin shell over the Python
API (each option one keyword argument): generate and chat (``generate.py``), convert and
verify (``convert.py``), perplexity (``quality.py``), embed, serve, bench, launch
(``distributed.py``), train-mtp (``train.py``), and the model store's pull, list, show, rm, cp, ps, stop, run (``store.py``).
"""

from __future__ import annotations

import click

from ..platform.blas import preload_openblas
from .bench import bench
from .convert import convert, verify
from .distributed import launch
from .embed import embed
from .generate import chat, generate
from .quality import perplexity
from .serve import serve
from .store import COMMANDS as STORE_COMMANDS
from .train import train_mtp


@click.group()
@click.version_option(package_name="mlxinfer")
def cli():
    """On-device LLM inference on MLX."""


for command in (
    generate,
    chat,
    convert,
    verify,
    perplexity,
    serve,
    bench,
    embed,
    launch,
    train_mtp,
    *STORE_COMMANDS,
):
    cli.add_command(command)


def main() -> None:
    preload_openblas()  # before anything imports mlx
    cli()
