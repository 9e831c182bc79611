"""The output's weight files, written while a conversion runs: safetensors shards of
:data:`SHARD_BYTES`, and their index when there is more than one (the layout the loader reads,
``loader.read_weights``). Inside the conversion's temporary directory (``files.atomic``), which is
flushed and renamed only when complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..platform.progress import Progress

SHARD_BYTES = 2 << 30  # 2 GiB per safetensors shard


class ShardWriter:
    """The output's safetensors shards (:data:`SHARD_BYTES` each), written as arrays are ready:
    a planned conversion hands over each layer once it is quantized (:meth:`layer`),
    :meth:`finish` writes the rest and names the files. A written array is replaced in the model
    by a lazy load of its shard (its shape and size, for the report; a lazy load keeps its file
    open, so the renames do not break it), so the quantized model is never all in memory."""

    def __init__(self, out: Path, model: nn.Module, progress: Progress) -> None:
        self.out, self.model, self.progress = out, model, progress
        self.pending: list[tuple[str, nn.Module, str, mx.array]] = []  # (name, module, key, array)
        self.size = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.added: set[str] = set()  # names pending or written
        self.done, self.total = 0, 0  # bytes; total known (and reported) from finish on

    def layer(self, path: str, module: nn.Module) -> None:
        for key, v in tree_flatten(module.parameters()):
            self._add(f"{path}.{key}", module, key, v)

    def _add(self, name: str, module: nn.Module, key: str, v: mx.array) -> None:
        if self.size and self.size + v.nbytes > SHARD_BYTES:
            self._flush()
        self.pending.append((name, module, key, v))
        self.added.add(name)
        self.size += v.nbytes

    def _flush(self) -> None:
        if not self.pending:
            return
        path = self.out / f".shard-{len(self.files):05d}.safetensors"  # named in finish
        mx.save_safetensors(
            str(path), {n: v for n, _, _, v in self.pending}, metadata={"format": "mlx"}
        )
        loaded = mx.load(str(path))
        for name, module, key, _ in self.pending:
            module.update(tree_unflatten([(key, loaded[name])]))
        self.files.append((path, [n for n, _, _, _ in self.pending]))
        self.done += self.size
        self.pending, self.size = [], 0
        if self.total:
            self.progress("writing weights", self.done, self.total)

    def finish(self) -> None:
        params = tree_flatten(self.model.parameters())
        self.total = sum(v.nbytes for _, v in params)
        self.progress("writing weights", self.done, self.total)
        for name, v in params:
            if name not in self.added:
                self._add(name, self.model, name, v)
        del params
        self._flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.out / "model.safetensors")
        else:
            weight_map = {}
            for i, (path, names) in enumerate(self.files):
                name = f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors"
                path.rename(self.out / name)
                weight_map.update({k: name for k in names})
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        self.progress("writing weights", self.total, self.total)
