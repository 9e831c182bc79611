"""Model names in the store: ``org/name[:variant]`` (a Hub repo id, with the GGUF quant where a
repo holds several), or an alias ``name[:variant]`` made by :func:`copy`. ``name`` and
``name:latest`` are one model. Anything else (``..``, a second ``/``, spaces, a path) is a
one-line :class:`StoreError`, before any file is touched."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import MlxInferError
from ..loading.loader import store_path

LATEST = "latest"
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_MAX = {"org": 96, "name": 96, "variant": 64}


class StoreError(MlxInferError):
    """A store operation that cannot be done: a bad name, a model not in the store, a Hub that
    refuses or answers nonsense, too little disk, a model a server holds."""


@dataclass(frozen=True)
class ModelName:
    org: str | None  # None: an alias (Ollama's "library" namespace)
    name: str
    variant: str | None  # None: "latest" (or, for a GGUF repo, its default quant)

    @property
    def repo(self) -> str:
        """The Hub repo id (``org/name``), or the alias alone."""
        return f"{self.org}/{self.name}" if self.org else self.name

    @property
    def tag(self) -> str:
        return self.variant or LATEST

    def __str__(self) -> str:
        return f"{self.repo}:{self.tag}"

    def path(self, root: Path | None = None) -> Path:
        """The model's directory in the store (there or not): loading's :func:`store_path`."""
        found = store_path(str(self), root)
        assert found is not None, self  # every parsed name is one store_path takes
        return found


def parse_name(text: str) -> ModelName:
    """``org/name[:variant]`` or ``name[:variant]`` as a :class:`ModelName`.

    Raises:
      StoreError: naming the text, what is expected and what was found.
    """
    expected = "expected 'org/name' or 'org/name:variant' (letters, digits, '_', '.', '-')"
    if not isinstance(text, str) or not text:
        raise StoreError(f"model name {text!r}: {expected}, found an empty name")
    repo, colon, variant = text.partition(":")
    parts = repo.split("/")
    if len(parts) > 2:
        raise StoreError(f"model name {text!r}: {expected}, found {len(parts) - 1} '/'")
    if colon and ":" in variant:
        raise StoreError(f"model name {text!r}: {expected}, found a second ':'")
    fields = dict(zip(("org", "name") if len(parts) == 2 else ("name",), parts))
    if colon:
        fields["variant"] = variant
    for field, value in fields.items():
        if ".." in value:
            raise StoreError(f"model name {text!r}: {expected}, found '..' in the {field}")
        if not _PART.match(value):
            bad = next(
                (c for c in value if not (c.isascii() and (c.isalnum() or c in "_.-"))), None
            )
            found = (
                f"the character {bad!r} in the {field}"
                if bad is not None
                else f"an empty {field}"
                if not value
                else f"the {field} {value!r} starting with {value[0]!r}"
            )
            raise StoreError(f"model name {text!r}: {expected}, found {found}")
        if len(value) > _MAX[field]:
            raise StoreError(
                f"model name {text!r}: {expected}, found a {field} of {len(value)} characters "
                f"(at most {_MAX[field]})"
            )
    return ModelName(fields.get("org"), fields["name"], fields.get("variant"))
