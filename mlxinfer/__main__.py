"""``python -m mlxinfer`` runs the CLI."""

from .cli.main import main

main()
