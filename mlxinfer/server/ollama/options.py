"""Ollama's ``options`` object (in an ``/api/chat`` or ``/api/generate`` body), checked: how much
to generate, the context, the sampler, the stop strings.

Fields follow the server's rule (``fields``, docs/server.md "Fields"): those acted on are
checked (a malformed value is a 400 naming ``options.<name>``); those with no local meaning
(``IGNORED_OPTIONS``: threads, GPU layers, mmap ...) and unknown ones are accepted, ignored and
logged once; those that would change the output and cannot be honoured (``REFUSED_OPTIONS``)
are a 400 unless their value asks for nothing. Unset ones take Ollama's own defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...generation.sampling import SamplingParams
from ..api_errors import OllamaError
from ..fields import Fields
from ..numbers import as_float, outside
from ..quoting import shown
from .messages import kind

SAMPLING_OPTIONS = {"temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty"}
USED_OPTIONS = SAMPLING_OPTIONS | {"stop", "num_predict", "num_ctx", "repeat_last_n"}
# Known, with no local meaning here (how llama.cpp loads and runs): accepted and ignored.
IGNORED_OPTIONS = {
    "numa",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "embedding_only",
    "num_thread",
    "num_keep",  # what llama.cpp keeps when it shifts the context: nothing is shifted here
    "penalize_newline",
    "mirostat_tau",  # only with mirostat, which is refused
    "mirostat_eta",
}
REFUSED_OPTIONS = {
    "presence_penalty": "not supported (only 0)",
    "frequency_penalty": "not supported (only 0)",
    "mirostat": "not supported (only 0)",
    "typical_p": "not supported (only 1)",
    "tfs_z": "not supported (only 1)",
}
OPTIONS = Fields.of(
    "/api options",
    USED_OPTIONS,
    IGNORED_OPTIONS,
    REFUSED_OPTIONS,
    {"typical_p": (1, 1.0), "tfs_z": (1, 1.0)},
)
# Ollama's own defaults (api/types.go DefaultOptions), which its clients are tuned for; its
# default repeat penalty is not applied (the OpenAI route has none either).
DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P = 0.8, 40, 0.9
DEFAULT_REPEAT_LAST_N = 64
MAX_INT = 2**31 - 1  # num_predict, num_ctx, top_k: past any context or vocabulary
MAX_SEED = 2**63 - 1
MAX_STOP = 64  # stop strings per request


@dataclass
class Options:
    """A checked ``options``: what the request generates and how."""

    max_tokens: int  # num_predict; MAX_INT for -1 or -2 (until the context is full)
    num_ctx: int | None  # the prompt and the reply within this many tokens
    sampling: SamplingParams
    stop: list[str]


def parse_options(options: Any) -> Options:
    """Check an ``options`` object (None: all defaults); OllamaError (400) naming the first bad
    option."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise OllamaError(400, f"options: expected an object, found {kind(options)}")
    refusal = OPTIONS.screen(options)
    if refusal is not None:
        raise OllamaError(400, f"options.{refusal.message}")
    num_predict = _option_int(options, "num_predict", -1, -2, MAX_INT)
    num_ctx = _option_int(options, "num_ctx", None, 1, MAX_INT)
    return Options(
        MAX_INT if num_predict < 0 else num_predict,  # -1, -2: until the context is full
        num_ctx,
        _sampling(options),
        _stop(options.get("stop")),
    )


def _sampling(options: dict) -> SamplingParams:
    seed = _option_int(options, "seed", None, -MAX_SEED, MAX_SEED)
    penalty = _option_number(options, "repeat_penalty", None, 0.0, 100.0, above=True)
    last_n = _option_int(options, "repeat_last_n", DEFAULT_REPEAT_LAST_N, -1, MAX_INT)
    if penalty == 1.0 or last_n == 0:  # 1: no penalty; 0 tokens looked at: none either
        penalty = None
    sampling = SamplingParams(
        temperature=_option_number(options, "temperature", DEFAULT_TEMPERATURE, 0.0, 100.0),
        top_k=_option_int(options, "top_k", DEFAULT_TOP_K, 0, MAX_INT),
        top_p=_option_number(options, "top_p", DEFAULT_TOP_P, 0.0, 1.0, above=True),
        min_p=_option_number(options, "min_p", 0.0, 0.0, 1.0, below=True),
        seed=seed if seed is not None and seed >= 0 else None,  # Ollama's -1: a random seed
        repetition_penalty=penalty,
        repetition_context_size=None if last_n == -1 else last_n,  # -1: the whole context
    )
    try:
        sampling.check()
    except ValueError as e:
        raise OllamaError(400, f"options: {e}") from None
    return sampling


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise OllamaError(400, f"options.stop: expected a list of strings, found {shown(stop)}")
    if len(stop) > MAX_STOP:
        raise OllamaError(400, f"options.stop: {len(stop)} strings, at most {MAX_STOP}")
    return [s for s in stop if s]


def _option_number(
    options: dict,
    name: str,
    default: float | None,
    lo: float,
    hi: float,
    *,
    above: bool = False,
    below: bool = False,
) -> float | None:
    """A number in [lo, hi] (``above``: > lo; ``below``: < hi), or ``default``."""
    value = options.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OllamaError(400, f"options.{name}: expected a number, found {kind(value)}")
    value = as_float(value)
    span = outside(value, lo, hi, above=above, below=below)
    if span is not None:
        raise OllamaError(400, f"options.{name}: expected a number in {span}, found {value:g}")
    return value


def _option_int(options: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = options.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():  # JSON numbers from JavaScript: 64.0
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise OllamaError(
            400, f"options.{name}: expected an integer in {lo}..{hi}, found {shown(value)}"
        )
    return value
