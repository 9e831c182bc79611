"""``python -m mlxinfer`` runs the CLI."""

from .cli import main

main()
