"""Which fields of a request body are acted on, which are ignored, which are refused.

The rule every endpoint follows (docs/server.md, "Fields"), as llama.cpp, Ollama and vLLM do,
so that a client's next release, which adds a field, does not lock its users out:

- a field the server uses is checked: a malformed value is a 400 naming it;
- a field with no local meaning (``metadata``, ``store``, ``cache_control`` ...) and a field
  the server does not know at all are accepted and ignored, each name logged once (logger
  ``mlxinfer.server``, level INFO for the known ones, WARNING for unknown ones);
- a field that would change the output and that the server cannot honour (``logit_bias`` ...)
  is a 400 naming it, unless its value is neutral (null, false, 0, an empty string, list or
  object, or one of the field's ``allowed`` values), which asks for nothing.

:func:`screen` sorts a body's field names by these rules; the caller raises the refusal in its
own API's error shape.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .quoting import named

log = logging.getLogger("mlxinfer.server")

MAX_LOGGED = 1024  # field names remembered as logged: a hostile client's inventions stay bounded
KEY_CHARS = 128  # of each name remembered
_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()


@dataclass(frozen=True)
class Refusal:
    """A field the request sets and the server cannot honour: ``field`` and why, one line."""

    field: str
    message: str


@dataclass(frozen=True)
class Fields:
    """An endpoint's fields: ``used`` (parsed and acted on), ``ignored`` (known, with no local
    meaning) and ``refused`` (name -> why it cannot be honoured: the output would differ;
    ``allowed``: name -> values of a refused field that ask for nothing, past the neutral ones,
    such as ``n: 1``)."""

    api: str  # for the log line, e.g. "/v1/messages"
    used: frozenset[str]
    ignored: frozenset[str] = frozenset()
    refused: Mapping[str, str] = field(default_factory=dict)
    allowed: Mapping[str, tuple] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        api: str,
        used: Iterable[str],
        ignored: Iterable[str] = (),
        refused: Mapping[str, str] | None = None,
        allowed: Mapping[str, tuple] | None = None,
    ) -> Fields:
        return cls(
            api, frozenset(used), frozenset(ignored), dict(refused or {}), dict(allowed or {})
        )

    def screen(self, body: Mapping[str, Any]) -> Refusal | None:
        """Log the ignored and unknown fields of ``body`` (each name once per process) and
        return the first refused field set to a value that is not neutral, or None."""
        for name, value in body.items():
            if name in self.used:
                continue
            if name in self.refused:
                if not neutral(value) and value not in self.allowed.get(name, ()):
                    return Refusal(named(name), f"{named(name)}: {self.refused[name]}")
                continue
            log_once(self.api, name, known=name in self.ignored)
        return None


def neutral(value: Any) -> bool:
    """A value that asks for nothing: null, false, 0, "", [] or {}."""
    if isinstance(value, bool) or value is None:
        return not value
    if isinstance(value, (int, float)):
        return value == 0
    if isinstance(value, (str, list, dict)):
        return not value
    return False


def log_once(api: str, name: str, *, known: bool) -> None:
    """Log that ``name`` was ignored in a request to ``api``, the first time only (up to
    ``MAX_LOGGED`` names; one more line says when that many were seen)."""
    key = (api, name[:KEY_CHARS])  # a name as long as the body is not kept whole
    with _lock:
        if key in _logged or len(_logged) > MAX_LOGGED:
            return
        _logged.add(key)
        full = len(_logged) > MAX_LOGGED
    if full:
        log.warning("%s: more than %d ignored field names; no more are logged", api, MAX_LOGGED)
    elif known:
        log.info("%s: field %s ignored (no local meaning)", api, named(name))
    else:
        log.warning("%s: unknown field %s ignored", api, named(name))


def forget_logged() -> None:
    """Forget which names were logged (for tests)."""
    with _lock:
        _logged.clear()
