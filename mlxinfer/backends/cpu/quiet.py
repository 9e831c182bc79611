"""How much other work the machine did while the decode plans were timed.

A plan timed while something else runs (a pip build, another model, a second user of a shared
VM) is timed on fewer cores than a quiet run has: on a loaded 2-core VM that picked one kernel
thread and MLX's ops, the opposite of what the same machine picks quiet, and the plan cache
kept that choice for every later run (issue 47). So the timing is watched: the CPU time the
whole machine spent while it ran, less this process's own, as a fraction of the machine's CPUs
(Linux's ``/proc/stat`` and ``/proc/self/stat``; a hypervisor's *steal* time counts as other
work, since a shared VM's neighbours take the cores that way). Past :data:`BUSY` the plans are
used for the run that timed them but not cached (``plans.choose``).

Elsewhere (macOS, where the plans hardly matter: a Mac decodes on Metal) nothing is read and
the timing counts as quiet.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# Other work on more than a quarter of the machine's CPUs while timing: on 2 cores, one busy
# core of another process. The plans' choices differ by 3-30 % of a step (choices.KEEP_IF_FASTER),
# which another process on a core the timing wants outweighs.
BUSY = 0.25
_STAT = Path("/proc/stat")
_SELF = Path("/proc/self/stat")


def _machine_ticks() -> tuple[int, int] | None:
    """(busy ticks of all CPUs together, number of CPUs), or None where /proc is not there."""
    try:
        lines = _STAT.read_text().splitlines()
    except OSError:
        return None
    fields = lines[0].split()
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    # user nice system idle iowait irq softirq steal: everything but idle and iowait is busy
    values = [int(v) for v in fields[1:9]]
    busy = sum(values) - values[3] - values[4]
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
    return busy, max(cpus, 1)


def _own_ticks() -> int | None:
    """This process's user + system ticks, all its threads (MLX's streams, the kernels' pool)."""
    try:
        text = _SELF.read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime, stime (the stat's 14th and 15th fields)


class Watch:
    """``with Watch() as w: ...`` then ``w.others``: the fraction of the machine's CPUs other
    processes kept busy meanwhile (0 quiet, 1 every CPU), or None where it cannot be read."""

    others: float | None = None

    def __enter__(self) -> Watch:
        self._start = (time.monotonic(), _machine_ticks(), _own_ticks())
        return self

    def __exit__(self, *exc) -> None:
        t0, machine0, own0 = self._start
        machine1, own1 = _machine_ticks(), _own_ticks()
        wall = time.monotonic() - t0
        if None in (machine0, machine1, own0, own1) or wall <= 0:
            return
        assert machine0 is not None and machine1 is not None and own0 is not None
        assert own1 is not None
        hz = os.sysconf("SC_CLK_TCK")
        others = (machine1[0] - machine0[0]) - (own1 - own0)
        self.others = max(0.0, others / hz / (wall * machine1[1]))

    @property
    def busy(self) -> bool:
        return self.others is not None and self.others > BUSY
