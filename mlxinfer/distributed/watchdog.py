"""A bound on every distributed wait: a thread that ends the process when a step overruns.

A collective blocked on a peer that stalled (SIGSTOP, a hung machine, a cable pulled without
a reset) cannot be interrupted from Python: MLX waits inside C++ for bytes that never come,
and the accepting side of the ring waits forever. So each step runs inside
:meth:`Watchdog.step`; a thread sleeps until the step's deadline and, if the step is still
running then, writes one line naming the rank, the step, the peer waited on and the timeout
to stderr and ends the process with ``os._exit`` (exit code :data:`EXIT_CODE`). A peer
that *died* needs no watchdog: MLX raises a catchable error about 50 ms later (``group``
turns it into a DistributedError). MLX releases the GIL while it evaluates, so the thread can
run then; ``mx.distributed.init`` does not, and is bounded by a child process instead
(:meth:`Watchdog.outside`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

DEFAULT_RANK_TIMEOUT = 120.0  # seconds a step may wait on the other ranks (--rank-timeout)
EXIT_CODE = 3  # the process's exit code when a step overran its bound


def _die(message: str) -> None:
    sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


class Watchdog:
    """One per process: bounds the distributed steps run inside :meth:`step`.

    ``on_timeout(message)`` runs on the watchdog's thread when a step overruns (default: the
    message on stderr, then ``os._exit(3)``: the blocked thread can never be woken).
    """

    def __init__(
        self,
        rank: int,
        timeout: float = DEFAULT_RANK_TIMEOUT,
        on_timeout: Callable[[str], None] = _die,
    ):
        if not timeout > 0:
            raise ValueError(
                f"rank_timeout: expected a positive number of seconds, found {timeout!r}"
            )
        self.rank, self.timeout, self.on_timeout = rank, float(timeout), on_timeout
        self._lock = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._thread: threading.Thread | None = None

    def _watch(self) -> None:
        with self._lock:
            while True:
                if self._deadline is None:
                    self._lock.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._lock.wait(left)
                    continue
                message = self._message(self._what)
                self._deadline, self._thread = None, None
                break
        self.on_timeout(message)

    @contextmanager
    def outside(self, what: str) -> Iterator[None]:
        """Bound a block that holds the GIL while it waits (``mx.distributed.init``: the
        watchdog's thread could never run): a child process waits on a pipe for the block to
        end and, past the timeout, writes the message and kills this process (SIGKILL)."""
        message = self._message(what)
        code = (
            "import os, select, signal, sys\n"
            f"if not select.select([sys.stdin], [], [], {self.timeout!r})[0]:\n"
            f"    sys.stderr.write({('Error: ' + message + chr(10))!r}); sys.stderr.flush()\n"
            f"    os.kill({os.getpid()}, signal.SIGKILL)\n"
        )
        child = subprocess.Popen([sys.executable, "-I", "-S", "-c", code], stdin=subprocess.PIPE)
        try:
            yield
        finally:
            child.stdin.close()  # EOF: the child exits
            child.wait()

    def _message(self, what: str) -> str:
        return (
            f"rank {self.rank}: {what} did not finish within the rank timeout "
            f"({self.timeout:g} s, --rank-timeout): a rank stalled or is unreachable; exiting"
        )

    @contextmanager
    def step(self, what: str, timeout: float | None = None) -> Iterator[None]:
        """Bound the block to ``timeout`` (default: the watchdog's) seconds; ``what`` names
        the step and the peer it waits on, for the message."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="mlxinfer-rank-watchdog", daemon=True
                )
                self._thread.start()
            outer = (self._deadline, self._what)
            self._deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            self._what = what
            self._lock.notify()
        try:
            yield
        finally:
            with self._lock:
                self._deadline, self._what = outer
                self._lock.notify()
