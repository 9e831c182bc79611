"""``serve --model-alias GLOB=NAME``: the model names a client sends (Claude Code's
``claude-opus-4-8``, Codex's ``gpt-5-codex``) mapped onto the served models.

A served model's own name always wins; then the aliases, in the order given, by
``fnmatch`` glob (case-sensitive); a name that neither matches stays a 404.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from ..errors import MlxInferError

MAX_ALIASES = 256


class AliasError(MlxInferError, ValueError):
    """A ``--model-alias`` that is not ``GLOB=NAME``."""


def parse_aliases(specs: list[str] | None) -> list[tuple[str, str]]:
    """``["claude-*=NAME", ...]`` as ``[(glob, name), ...]``; AliasError naming a bad one."""
    out = []
    for spec in specs or ():
        glob, sep, name = str(spec).partition("=")
        glob, name = glob.strip(), name.strip()
        if not sep or not glob or not name:
            raise AliasError(
                f"--model-alias {spec!r}: expected GLOB=NAME, e.g. 'claude-*=SmolLM2-135M-Instruct'"
            )
        out.append((glob, name))
    if len(out) > MAX_ALIASES:
        raise AliasError(f"--model-alias: at most {MAX_ALIASES} aliases, got {len(out)}")
    return out


def check_targets(aliases: list[tuple[str, str]], names: list[str]) -> None:
    """AliasError when an alias names a model this server does not serve."""
    for glob, name in aliases:
        if name not in names:
            raise AliasError(
                f"--model-alias '{glob}={name}': no served model is named {name!r} "
                f"(this server has: {', '.join(names) or 'none'})"
            )


def resolve(requested: str, aliases: list[tuple[str, str]]) -> str | None:
    """The served name the first matching alias gives ``requested``, or None."""
    for glob, name in aliases:
        if fnmatchcase(requested, glob):
            return name
    return None
