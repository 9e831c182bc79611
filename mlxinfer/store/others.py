"""Models other apps downloaded that mlxinfer runs in place, found read-only (never written,
never removed): the Hugging Face cache's MLX-format repos (``mlx-community/*`` and any other
with MLX's quantization record), LM Studio's model folder, Ollama's GGUF blobs.

Folders: ``HF_HUB_CACHE`` (else ``HF_HOME``/hub, else ~/.cache/huggingface/hub);
``LMSTUDIO_MODELS`` (else ~/.lmstudio/models, ~/.cache/lm-studio/models); ``OLLAMA_MODELS``
(else ~/.ollama/models).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

_MAX_JSON = 1 << 20


def _json(path: Path) -> dict | None:
    try:
        if path.stat().st_size > _MAX_JSON:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home).expanduser() / "hub"


def _hf_cache() -> Iterator[tuple[str, Path, str]]:
    root = hf_cache_dir()
    if not root.is_dir():
        return
    for repo in sorted(root.glob("models--*--*")):
        ref = repo / "refs" / "main"
        try:
            commit = ref.read_text().strip()
        except OSError:
            continue
        snapshot = repo / "snapshots" / commit
        config = _json(snapshot / "config.json")
        if config is None or not any(snapshot.glob("*.safetensors")):
            continue
        org, name = repo.name[len("models--") :].split("--", 1)
        if org == "mlx-community" or isinstance(config.get("quantization"), dict):
            yield f"{org}/{name}", snapshot, "hf-cache"


def _lm_studio() -> Iterator[tuple[str, Path, str]]:
    given = os.environ.get("LMSTUDIO_MODELS")
    roots = [Path(given).expanduser()] if given else [
        Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]  # fmt: skip
    for root in roots:
        if not root.is_dir():
            continue
        for repo in sorted(p for p in root.glob("*/*") if p.is_dir()):
            name = f"{repo.parent.name}/{repo.name}"
            if (repo / "config.json").is_file() and any(repo.glob("*.safetensors")):
                yield name, repo, "lm-studio"
            for gguf in sorted(repo.glob("*.gguf")):
                yield f"{name}/{gguf.name}", gguf, "lm-studio"


def _ollama() -> Iterator[tuple[str, Path, str]]:
    given = os.environ.get("OLLAMA_MODELS")
    root = Path(given).expanduser() if given else Path.home() / ".ollama" / "models"
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for path in sorted(p for p in manifests.rglob("*") if p.is_file()):
        manifest = _json(path)
        layers = manifest.get("layers") if manifest else None
        if not isinstance(layers, list):
            continue
        for layer in layers:
            if (
                not isinstance(layer, dict)
                or layer.get("mediaType") != "application/vnd.ollama.image.model"
            ):
                continue
            digest = str(layer.get("digest", ""))
            if not digest.startswith("sha256:") or not digest[7:].isalnum():
                continue
            blob = root / "blobs" / digest.replace(":", "-")
            parts = path.relative_to(manifests).parts
            if blob.is_file() and len(parts) >= 3:
                *_, namespace, model, tag = parts
                shown = model if namespace == "library" else f"{namespace}/{model}"
                yield f"ollama:{shown}:{tag}", blob, "ollama"


def other_models() -> list[tuple[str, Path, str]]:
    """``(name, path, source)`` of each model found; a directory or a GGUF file."""
    found = []
    for source in (_hf_cache, _lm_studio, _ollama):
        try:
            found.extend(source())
        except OSError:  # an unreadable folder of another app: skipped
            continue
    return found
