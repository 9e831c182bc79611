"""``mlxinfer launch``: start n local ranks of a command and take them down together.

MLX's own ``mlx.launch`` exits 0 even when a rank fails, and a launcher that is killed
leaves its ranks running. This one writes a ring hostfile on 127.0.0.1 with free ports (or
uses the one given, whose rank count must be n), starts each rank in a process group of its
own with ``MLX_RANK`` and ``MLX_HOSTFILE`` set, and then:

- exits with the first failing rank's code (128 + the signal for a rank killed by one) as
  soon as a rank fails, after ending the others (SIGTERM to their groups, SIGKILL after
  ``grace`` seconds), or with 0 once every rank has exited with 0;
- on SIGINT, SIGTERM or SIGHUP ends every rank the same way (exit code 128 + the signal).
  SIGKILL cannot be caught: on Linux the ranks ask for SIGKILL when their parent dies
  (``PR_SET_PDEATHSIG``), but that did not take effect on the sandboxed test machine, where
  the ranks of a SIGKILLed launcher ran on to their own end;
- with ``timeout``, ends everything after that many seconds (exit code 124).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import DistributedError
from .group import read_hostfile

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
POLL_S = 0.05


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 now (held open together, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def local_hostfile(n: int, directory: str | os.PathLike) -> Path:
    """A ring hostfile for ``n`` ranks on 127.0.0.1, written in ``directory``."""
    path = Path(directory) / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    return path


def check_local(path: str | os.PathLike, n: int) -> Path:
    """``path``'s hostfile, checked to list ``n`` ranks, all on this machine."""
    hosts = read_hostfile(path)
    if len(hosts) != n:
        raise DistributedError(
            f"{path}: {len(hosts)} ranks, but -n {n} (expected one entry per rank)"
        )
    for i, entry in enumerate(hosts):
        for address in entry:
            host = address.rpartition(":")[0].strip("[]")
            if host not in LOCAL_HOSTS:
                raise DistributedError(
                    f"{path}: rank {i} is on {host}: `mlxinfer launch` starts ranks on this "
                    "machine only; across machines use `mlx.launch --hostfile` "
                    "(docs/distributed.md)"
                )
    return Path(path)


def _die_with_parent() -> None:  # in the child, before exec
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _end(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every live rank's process group, SIGKILL to those alive ``grace`` s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def launch(
    command: list[str],
    n: int,
    *,
    hostfile: str | os.PathLike | None = None,
    grace: float = 5.0,
    timeout: float | None = None,
    log=None,
) -> int:
    """Run ``command`` as ranks 0..n-1 on this machine; returns the exit code (see above)."""
    if not command:
        raise DistributedError("launch: no command to run (put it after `--`)")
    if not 1 <= n <= 64:
        raise DistributedError(f"launch: -n {n}: expected 1..64 ranks")
    procs: list[subprocess.Popen] = []

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    # Set even where a shell started the launcher with SIGINT ignored (a background job).
    caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, on_term) for sig in caught}
    try:
        with tempfile.TemporaryDirectory(prefix="mlxinfer-launch-") as tmp:
            path = check_local(hostfile, n) if hostfile else local_hostfile(n, tmp)
            for rank in range(n):
                env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(path)}
                procs.append(
                    subprocess.Popen(
                        command,
                        env=env,
                        stdin=None if rank == 0 else subprocess.DEVNULL,
                        preexec_fn=_die_with_parent,
                    )
                )
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                codes = [p.poll() for p in procs]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    rank, code = failed[0]
                    if log is not None:
                        log(f"launch: rank {rank} exited with {exit_code(code)}; ending the others")
                    _end(procs, grace)
                    return exit_code(code) or 1
                if all(c == 0 for c in codes):
                    return 0
                if deadline is not None and time.monotonic() > deadline:
                    if log is not None:
                        log(f"launch: the ranks ran past --timeout {timeout:g} s; ending them")
                    _end(procs, grace)
                    return 124
                time.sleep(POLL_S)
    except FileNotFoundError as e:
        raise DistributedError(f"launch: cannot run {command[0]!r} ({e.strerror})") from None
    finally:
        _end(procs, grace)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
