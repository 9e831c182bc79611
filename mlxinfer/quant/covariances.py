"""GPTQ's input covariances kept on disk while a plan runs (issue 48, item 5: a 70B model).

A layer's input second moment ``x x^T`` is K x K float32: 268 MB for Llama-3.1-70B's q/k/v
input (K 8,192), 3.3 GB for its down projection's (K 28,672), about 4.1 GB a block and 330 GB
for the model's 80 blocks, never to be held in memory together. The layer-by-layer calibration
(``layerwise.calibrate``) adds each block's sums to files here once the block is evaluated
(:meth:`CovarianceStore.add`), so memory holds one block's; :meth:`CovarianceStore.finish`
turns the sums into means in place, and the rounding reads them back memory-mapped, one layer
at a time (``transform.quantize_model``). The files live in a temporary folder (``TMPDIR``,
or ``directory``) removed by :meth:`CovarianceStore.close`, or when the store is garbage
collected or the process exits. Disk needed: K**2 * 4 bytes per distinct input, checked before
each new file is written.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ConfigError


class CovarianceStore(Mapping[str, np.ndarray]):
    """``path -> mean x x^T`` (float32, memory-mapped read-only) once :meth:`finish` ran; the
    layers reading one input (q/k/v, gate/up) share one file and one array object."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mlxinfer-covariances-", dir=directory))
        self._removal = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.files: dict[str, Path] = {}  # the first reader's path -> its sum's file
        self.shares: dict[str, str] = {}  # every reader's path -> the first reader's
        self._arrays: dict[str, np.ndarray] = {}  # first reader's path -> its open memmap

    def add(self, first: str, xtx: mx.array) -> None:
        """Add ``xtx`` (K, K), a sum of ``x x^T``, to ``first``'s file (made on first use)."""
        a = np.asarray(xtx, dtype=np.float32)
        file = self.files.get(first)
        if file is None:
            free = shutil.disk_usage(self.dir).free
            if free < a.nbytes:
                raise ConfigError(
                    f"--rounding gptq: the input covariance of {first} needs {a.nbytes} bytes "
                    f"of temporary space in {self.dir.parent}, {free} free (set TMPDIR to a "
                    "larger disk, or use --rounding mse)"
                )
            file = self.files[first] = self.dir / f"{len(self.files)}.npy"
            out = np.lib.format.open_memmap(file, mode="w+", dtype=np.float32, shape=a.shape)
            out[...] = a
        else:
            out = np.lib.format.open_memmap(file, mode="r+")
            out += a
        out.flush()
        del out

    def finish(self, shares: Mapping[str, str], tokens: Mapping[str, int]) -> None:
        """Each sum divided by its input's token count, in place: the store then maps every
        reader's path (``shares``: reader -> first reader) to its input's mean."""
        for first, file in self.files.items():
            out = np.lib.format.open_memmap(file, mode="r+")
            out /= np.float32(max(tokens.get(first, 0), 1))
            out.flush()
            del out
        self.shares = {p: f for p, f in shares.items() if f in self.files}

    def __getitem__(self, path: str) -> np.ndarray:
        first = self.shares[path]
        if first not in self._arrays:
            self._arrays[first] = np.load(self.files[first], mmap_mode="r")
        return self._arrays[first]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shares)

    def __len__(self) -> int:
        return len(self.shares)

    def close(self) -> None:
        """Remove the files (the arrays handed out must no longer be read)."""
        self._arrays.clear()
        self._removal()
