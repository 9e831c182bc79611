"""The JSON Ollama's routes send back: times (RFC 3339), durations (integer nanoseconds), a
model's list entry (``/api/tags``, ``/api/ps``: ``model`` and ``name`` both), ``/api/show``'s
details, ``model_info`` and capabilities, and the chunks of a reply.

What is told of a model comes from its directory (config.json, the weights' sizes) and from
the tokenizer actually in use (its chat template, ``serve --chat-template``'s included): a
served model is described without loading it.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ...generation.results import GenerationStats

VERSION = "0.9.0"  # the Ollama API this one follows (think, tool_name): clients want >= 0.6.4
LATEST = "latest"
FAR_FUTURE = "2318-01-01T00:00:00Z"  # expires_at of a model kept loaded (Ollama shows the same)
MAX_CONFIG_BYTES = 4 << 20  # a config.json larger than this is not read


def rfc3339(seconds: float) -> str:
    """A Unix time as RFC 3339 in UTC (``2026-01-02T03:04:05.678901Z``)."""
    stamp = datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="microseconds")
    return stamp.replace("+00:00", "Z")


def nanoseconds(seconds: float) -> int:
    return max(0, int(round(seconds * 1e9))) if math.isfinite(seconds) else 0


def listed(name: str) -> str:
    """A served name as Ollama lists it: with its tag (``:latest`` when it has none)."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:{LATEST}"


def canonical(requested: str, names: list[str]) -> str:
    """The served name a client's model name means: itself, else the same without
    ``:latest`` (or with it), else the one equal to it ignoring case."""
    if requested in names:
        return requested
    bare = requested.removesuffix(f":{LATEST}")
    for candidate in (bare, listed(bare)):
        if candidate in names:
            return candidate
    lower = {n.lower(): n for n in names}
    for candidate in (requested, bare, listed(bare)):
        if candidate.lower() in lower:
            return lower[candidate.lower()]
    return bare if bare != requested else requested


# --- a model, described -----------------------------------------------------------------------


def read_config(directory: Path | None) -> dict:
    """config.json of a model directory ({} when there is none to read)."""
    if directory is None:
        return {}
    file = Path(directory) / "config.json"
    try:
        if file.stat().st_size > MAX_CONFIG_BYTES:
            return {}
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _text_config(config: dict) -> dict:
    """A multimodal checkpoint's language model's part (``text_config``), else the config."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def architecture(config: dict, model=None) -> str:
    args = getattr(model, "args", None)
    kind = getattr(args, "model_type", None) or _text_config(config).get("model_type")
    return kind if isinstance(kind, str) and kind else "unknown"


def context_length(config: dict, model=None) -> int | None:
    """The model's context in tokens, from its loaded arguments or its config."""
    value = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    if not isinstance(value, int):
        text = _text_config(config)
        for key in ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len"):
            value = text.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                break
    return value if isinstance(value, int) and value > 0 else None


def weights_bytes(directory: Path | None) -> int:
    if directory is None:
        return 0
    try:
        return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))
    except OSError:
        return 0


def modified(directory: Path | None, default: float) -> float:
    try:
        return (Path(directory) / "config.json").stat().st_mtime if directory else default
    except OSError:
        return default


def quantization_level(config: dict) -> str:
    """``Q4`` for MLX 4-bit weights (``Q4-mixed`` when layers differ), else the stored float
    type (``F32``, ``BF16``, ``F16``)."""
    record = config.get("quantization") or config.get("quantization_config")
    if isinstance(record, dict) and isinstance(record.get("bits"), int):
        mixed = any(isinstance(v, dict) for v in record.values())
        return f"Q{record['bits']}" + ("-mixed" if mixed else "")
    dtype = _text_config(config).get("torch_dtype") or config.get("dtype")
    names = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    return names.get(dtype, "") if isinstance(dtype, str) else ""


def details(config: dict, model=None) -> dict:
    arch = architecture(config, model)
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": arch,
        "families": [arch],
        "parameter_size": "",
        "quantization_level": quantization_level(config),
    }


def digest(name: str, directory: Path | None, mtime: float) -> str:
    """A stable id for the model as served (clients key their caches by it): its name, folder
    and the folder's time, hashed."""
    return hashlib.sha256(f"{name}\0{directory}\0{mtime}".encode()).hexdigest()


def entry(name: str, directory: Path | None, config: dict, started: float, model=None) -> dict:
    """A model of ``/api/tags`` (``model`` and ``name`` both, as the clients read one or the
    other)."""
    mtime = modified(directory, started)
    shown = listed(name)
    return {
        "name": shown,
        "model": shown,
        "modified_at": rfc3339(mtime),
        "size": weights_bytes(directory),
        "digest": digest(name, directory, mtime),
        "details": details(config, model),
    }


def running(base: dict, context: int | None, expires: float, unified: bool) -> dict:
    """A loaded model of ``/api/ps``: its list entry, when it will be unloaded, its context."""
    return {
        **base,
        "expires_at": FAR_FUTURE if math.isinf(expires) else rfc3339(expires),
        "size_vram": base["size"] if unified else 0,  # Metal: the weights are in GPU memory
        "context_length": context or 0,
    }


def capabilities(tokenizer, embedding: bool, vision: bool = False) -> list[str]:
    """What the model does as served: ``embedding`` for an embedding checkpoint; otherwise
    ``completion``, with ``tools`` when its chat template shows the model the tools,
    ``thinking`` when the template marks reasoning (think tags, harmony), and ``vision`` when
    it reads images (``vision``: it has a vision tower, as Ollama says of such a model)."""
    if embedding:
        return ["embedding"]
    from ...output.reasoning import reasoning_format
    from ..templating import shows_tools

    out = ["completion"]
    if tokenizer is not None and getattr(tokenizer, "has_chat_template", False):
        if shows_tools(tokenizer):
            out.append("tools")
        if reasoning_format(tokenizer) is not None:
            out.append("thinking")
    if vision:
        out.append("vision")
    return out


def show(
    name: str,
    directory: Path | None,
    config: dict,
    tokenizer,
    embedding: bool,
    started: float,
    model=None,
    vision: bool = False,
) -> dict:
    """``/api/show``: details, ``model_info`` (never null: clients index it) with
    ``general.architecture`` and ``<arch>.context_length``, the template, capabilities."""
    arch = architecture(config, model)
    text = _text_config(config)
    info: dict[str, Any] = {"general.architecture": arch, "general.basename": name}
    context = context_length(config, model)
    if context is not None:
        info[f"{arch}.context_length"] = context
    for key, ours in (
        ("hidden_size", "embedding_length"),
        ("num_hidden_layers", "block_count"),
        ("num_attention_heads", "attention.head_count"),
        ("num_key_value_heads", "attention.head_count_kv"),
        ("vocab_size", "vocab_size"),
    ):
        if isinstance(text.get(key), int):
            info[f"{arch}.{ours}"] = text[key]
    template = ""
    if tokenizer is not None and getattr(tokenizer, "has_chat_template", False):
        template = tokenizer.chat_template_source() or ""
    return {
        "license": "",
        "modelfile": f"# served by mlxinfer\nFROM {name}\n",
        "parameters": "",
        "template": template,
        "details": details(config, model),
        "model_info": info,
        "capabilities": capabilities(tokenizer, embedding, vision),
        "modified_at": rfc3339(modified(directory, started)),
    }


# --- a reply ------------------------------------------------------------------------------------


def durations(stats: GenerationStats, tokens: int, total_s: float) -> dict:
    """Ollama's counts and timings, in integer nanoseconds."""
    eval_s = tokens / stats.decode_tps if stats.decode_tps else 0.0
    return {
        "total_duration": nanoseconds(total_s),
        "load_duration": 0,  # a model loads before its first request's clock starts
        "prompt_eval_count": stats.prompt_tokens,
        "prompt_eval_duration": nanoseconds(stats.time_to_first_token_s),
        "eval_count": tokens,
        "eval_duration": nanoseconds(eval_s),
    }


def chunk(ask, text: str, thinking: str = "", calls=None) -> dict:
    """A reply's piece (or, with ``done`` added, its end): ``message`` for /api/chat,
    ``response`` for /api/generate; ``thinking`` where the model reasoned."""
    out: dict[str, Any] = {"model": ask.model, "created_at": rfc3339(time.time())}
    if ask.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [tool_call(c, i) for i, c in enumerate(calls)]
        out["message"] = message
    else:
        out["response"] = text
        if thinking:
            out["thinking"] = thinking
    out["done"] = False
    return out


def tool_call(call, index: int) -> dict:
    """A parsed call as Ollama sends it: the arguments as an object."""
    return {
        "id": call.id,
        "function": {"index": index, "name": call.name, "arguments": call.arguments},
    }
