"""The ranks: joining them (hostfile checks, bounded), and every collective wait, bounded.

A run is one process per rank, started by ``mlx.launch``, by ``mlxinfer launch``, or by hand
with MLX's own environment: ``MLX_RANK`` (0..n-1) and ``MLX_HOSTFILE`` (the ring backend's
JSON list of each rank's ``["host:port"]``). :func:`connect` checks that environment, joins
the group under the watchdog, and returns a :class:`Ranks`; its :meth:`Ranks.run` is the
only place this package evaluates arrays, so that every wait on a peer is bounded and a
peer's death is one DistributedError naming it.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import threading
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx

from ..errors import DistributedError
from ..loading.memory import size_text
from .watchdog import DEFAULT_RANK_TIMEOUT, Watchdog

MAX_HOSTFILE_BYTES = 1 << 20
LOAD_WAIT_S = 1800.0  # how long ranks wait for each other to finish loading


def read_hostfile(path: str | os.PathLike) -> list[list[str]]:
    """The ring backend's hostfile: a JSON list with one list of ``"host:port"`` strings per
    rank; a DistributedError naming the file and what is wrong otherwise."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_HOSTFILE_BYTES:
            raise DistributedError(f"{path}: hostfile larger than 1 MB")
        hosts = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DistributedError(f"{path}: unreadable hostfile ({type(e).__name__}: {e})") from None
    if not isinstance(hosts, list) or not hosts:
        raise DistributedError(f"{path}: expected a JSON list with one entry per rank")
    for i, entry in enumerate(hosts):
        if isinstance(entry, str):
            entry = [entry]
        ok = isinstance(entry, list) and entry and all(isinstance(a, str) for a in entry)
        if not ok or not all(a.rpartition(":")[2].isdigit() for a in entry):
            raise DistributedError(
                f"{path}: rank {i}'s entry should be a list of 'host:port' strings, "
                f"found {entry!r:.80}"
            )
        hosts[i] = entry
    return hosts


def check_environment(expected_size: int | None = None) -> tuple[int, int] | None:
    """(rank, size) from ``MLX_RANK`` and ``MLX_HOSTFILE`` when both are set (None
    otherwise), checked: the rank in range, the hostfile readable, and its rank count
    ``expected_size`` when given."""
    rank_text, hostfile = os.environ.get("MLX_RANK"), os.environ.get("MLX_HOSTFILE")
    if rank_text is None or hostfile is None:
        return None
    hosts = read_hostfile(hostfile)
    if expected_size is not None and len(hosts) != expected_size:
        raise DistributedError(
            f"{hostfile}: {len(hosts)} ranks, but {expected_size} were asked for (expected "
            "one entry per rank)"
        )
    if not rank_text.isdigit() or int(rank_text) >= len(hosts):
        raise DistributedError(
            f"MLX_RANK={rank_text!r}: expected 0..{len(hosts) - 1} (the ranks of {hostfile})"
        )
    return int(rank_text), len(hosts)


class Ranks:
    """This process's place in the group and the bounded waits on the others."""

    def __init__(self, group: mx.distributed.Group, watchdog: Watchdog):
        self.group, self.watchdog = group, watchdog
        self.rank, self.size = group.rank(), group.size()
        # Per-rank statistics: the model's steps, the weight bytes this rank holds, the most
        # bytes its caches held after a step, and the seconds spent computing (its layers,
        # with their sends or all-reduces) or waiting (receives, the token check, the shared
        # logits).
        self.steps, self.weight_bytes, self.kv_bytes = 0, 0, 0
        self.seconds = {"computing": 0.0, "waiting": 0.0}

    def summary(self) -> str:
        """One line of this rank's statistics (``--verbose``)."""
        busy, wait = self.seconds["computing"], self.seconds["waiting"]
        share = 100 * wait / (busy + wait) if busy + wait else 0.0
        return (
            f"rank {self.rank}/{self.size}: {self.weight_bytes / 1e6:.1f} MB of weights, "
            f"{size_text(self.kv_bytes)} of keys and values at most, "
            f"{self.steps} steps, {busy:.2f} s computing, {wait:.2f} s waiting on other ranks "
            f"({share:.0f}%)"
        )

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def others(self) -> str:
        """The other ranks, named: "rank 1", "ranks 0, 2"."""
        others = [str(r) for r in range(self.size) if r != self.rank]
        return ("rank " if len(others) == 1 else "ranks ") + ", ".join(others)

    def run(
        self,
        what: str,
        arrays,
        peer: int | None = None,
        timeout: float | None = None,
        kind: str = "waiting",
    ) -> None:
        """Evaluate ``arrays`` (whose graph holds this step's collectives) within ``timeout``
        seconds (default: the rank timeout), the time counted as ``kind`` ("computing" or
        "waiting"). A peer that died is a DistributedError naming it (``peer``, or the
        others)."""
        waits_on = f"rank {peer}" if peer is not None else self.others()
        start = time.perf_counter()
        with self.watchdog.step(f"{what} (waiting on {waits_on})", timeout):
            try:
                mx.eval(arrays)
                self.seconds[kind] += time.perf_counter() - start
            except RuntimeError as e:
                reason = " ".join(str(e).split())[:200]
                raise DistributedError(
                    f"rank {self.rank}: lost {waits_on} during {what} ({reason}); "
                    "a rank died or closed its connection"
                ) from None

    def all_sum(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x, group=self.group)

    def broadcast(self, x: mx.array, what: str, root: int = 0) -> mx.array:
        """``x`` as ``root`` has it, on every rank (an all-sum with zeros elsewhere: exact)."""
        out = self.all_sum(x if self.rank == root else mx.zeros_like(x))
        self.run(what, out)
        return out

    def broadcast_pair(self, first: int, last: int) -> tuple[int, int]:
        """Rank 0's ``first`` and the last rank's ``last``, on every rank."""
        pair = mx.array([first if self.first else 0, last if self.last else 0], dtype=mx.int32)
        out = self.all_sum(pair)
        # The first wait after loading: a rank reading a large checkpoint from a slow disk
        # may be minutes behind the others.
        self.run(
            "waiting for every rank to load", out, timeout=max(self.watchdog.timeout, LOAD_WAIT_S)
        )
        a, b = out.tolist()
        return a, b

    def check_same(self, tokens: mx.array, what: str, why: str | None = None) -> None:
        """Every rank must feed the same tokens: one all-sum of a (size, n) table whose row r
        is rank r's; a DistributedError on every rank at once if any row differs from rank
        0's (sampling without a shared seed, a prompt that differs per rank). ``why``: what
        differed, for other integers than tokens."""
        flat = tokens.reshape(-1).astype(mx.int32)
        table = mx.zeros((self.size, flat.size), dtype=mx.int32)
        table[self.rank] = flat
        table = self.all_sum(table)
        self.run(what, table)
        differ = mx.any(table != table[:1], axis=1).tolist()
        if any(differ):
            bad = differ.index(True)
            if why is not None:
                raise DistributedError(f"rank {bad} at {what}: {why} (seen by rank {self.rank})")
            raise DistributedError(
                f"rank {bad} fed other tokens than rank 0 at {what} (seen by rank {self.rank}; "
                "sampling at temperature > 0 needs a seed shared by every rank: pass seed=, "
                "as the CLI does; or the prompt differs per rank)"
            )

    def share_text(self, text: str, limit: int = 16 << 20) -> str:
        """Rank 0's ``text`` on every rank (a prompt read from rank 0's stdin)."""
        data = text.encode() if self.first else b""
        if len(data) > limit:
            raise DistributedError(f"prompt: {len(data)} bytes, more than the {limit} shared")
        n = int(self.broadcast(mx.array(len(data), dtype=mx.int32), "sharing the prompt"))
        if n == 0:
            return ""
        raw = mx.array(list(data) if self.first else [0] * n, dtype=mx.uint8)
        return bytes(self.broadcast(raw, "sharing the prompt").tolist()).decode()

    def share_line(self, read: Callable[[], str], beat: float = 0.5) -> str | None:
        """Rank 0's next line from ``read`` (a person typing in ``chat``) on every rank, None
        at its end (EOFError, Ctrl-D). While rank 0 waits for it, the ranks exchange whether
        it came every ``beat`` seconds: each wait stays bounded however long the typing."""
        box: queue.Queue = queue.Queue()
        if self.first:

            def reader() -> None:
                try:
                    box.put(read())
                except (EOFError, KeyboardInterrupt):
                    box.put(None)

            threading.Thread(target=reader, name="mlxinfer-read-line", daemon=True).start()
        while True:
            status, line = 0, None  # 0: still waiting, 1: a line, 2: the end
            if self.first:
                try:
                    line = box.get(timeout=beat)
                    status = 1 if line is not None else 2
                except queue.Empty:
                    pass
            status = int(self.broadcast(mx.array(status, dtype=mx.int32), "waiting for a line"))
            if status == 1:
                return self.share_text(line or "")
            if status == 2:
                return None

    def shared_seed(self, seed: int | None = None) -> int:
        """``seed``, or one drawn by rank 0, the same on every rank."""
        mine = secrets.randbits(31) if seed is None else seed
        return int(self.broadcast(mx.array(mine % (1 << 31), dtype=mx.int32), "sharing a seed"))


def connect(
    rank_timeout: float = DEFAULT_RANK_TIMEOUT,
    *,
    backend: str = "any",
    expected_size: int | None = None,
    on_timeout: Callable[[str], None] | None = None,
) -> Ranks:
    """Join the ranks MLX's environment describes, within ``rank_timeout`` seconds.

    A hostfile that does not parse, a rank out of its range or a rank count other than
    ``expected_size`` is a DistributedError before any connection; ranks that do not all
    show up within the timeout end the process (the watchdog).
    """
    env = check_environment(expected_size)
    rank = env[0] if env is not None else 0
    kwargs = {} if on_timeout is None else {"on_timeout": on_timeout}
    watchdog = Watchdog(rank, rank_timeout, **kwargs)
    hosts = os.environ.get("MLX_HOSTFILE", "MLX's environment")
    ranks = f"the {env[1]} ranks" if env is not None else "the ranks"
    with watchdog.outside(f"joining {ranks} of {hosts} (are they all started?)"):
        try:
            group = mx.distributed.init(strict=True, backend=backend)
        except RuntimeError as e:
            reason = " ".join(str(e).split())[:200]
            raise DistributedError(
                f"no distributed group ({reason}): start the ranks with `mlxinfer launch -n N "
                "-- ...` or `mlx.launch`, or set MLX_RANK and MLX_HOSTFILE (docs/distributed.md)"
            ) from None
    if env is not None and group.size() != env[1]:
        raise DistributedError(
            f"{hosts}: {env[1]} ranks in the hostfile, but the group has {group.size()}"
        )
    return Ranks(group, watchdog)


_RANKS: Ranks | None = None


def current(rank_timeout: float | None = None, **kwargs) -> Ranks:
    """This process's ranks, joined on first use (:func:`connect`); ``rank_timeout`` given
    later sets the bound of the steps after it."""
    global _RANKS
    if _RANKS is None:
        _RANKS = connect(DEFAULT_RANK_TIMEOUT if rank_timeout is None else rank_timeout, **kwargs)
    elif rank_timeout is not None:
        _RANKS.watchdog.timeout = float(rank_timeout)
    return _RANKS
