"""SIGKILL ``mlxinfer convert`` at random moments: it leaves nothing or a complete model, and a
rerun succeeds (or says the complete model is already there).

A small random llama checkpoint (tests/hf_models.py; ~50 MB of float32, so that writing
takes a while) is converted by the CLI in a child process, killed at N seeded moments.
Half the moments are uniform over a whole run (from the start of the process), half
uniform over its writing phase (from the moment the temporary directory appears); the
durations come from two unkilled runs first (the longer run, the shorter writing phase). After each kill:

- the destination is absent, or a complete model: ``mlxinfer.verify`` passes (every file's
  size and SHA-256) and it loads and runs a forward pass with finite logits;
- a rerun of the same command (a child process, as a user would) succeeds when the
  destination was absent, or exits 1 saying a complete model already exists there;
- after the rerun the destination verifies and no temporary sibling (debris of the killed
  run) is left.

    python tools/kill_convert.py                   # 20 moments, seed 0
    python tools/kill_convert.py -n 100 --seed 7

The last line is the summary, e.g. ``20/20 kills left nothing or a complete model ...``;
the exit status is 1 if any moment failed. tests/files/test_crash_safety.py uses these helpers
with a few chosen moments.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]
os.environ.setdefault("MLXINFER_CPU_PLANS", "off")  # loads here check files, not speed

from mlxinfer.platform.blas import preload_openblas  # noqa: E402

preload_openblas()

MID = dict(  # ~13M parameters: ~50 MB at float32
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=320,
)
COMPLETE = "a complete model already exists there"


def make_checkpoint(path: Path, **overrides) -> Path:
    """A random llama checkpoint with a tokenizer, for converting."""
    from hf_models import add_tokenizer, make_tiny

    path, _ = make_tiny(path, **{**MID, **overrides})
    add_tokenizer(path)
    return path


def convert_command(src: Path, dst: Path) -> list[str]:
    return [sys.executable, "-m", "mlxinfer", "convert", str(src), "-o", str(dst)]


def start(command: list[str], env: dict | None = None) -> subprocess.Popen:
    """The command in a child process; its stderr goes to a file (a pipe nobody reads could
    fill and stall it), read back by :func:`stderr_of`."""
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=err,
        env={**os.environ, **(env or {})},
    )
    proc.err_file = err
    return proc


def stderr_of(proc: subprocess.Popen) -> str:
    proc.err_file.seek(0)
    text = proc.err_file.read().decode(errors="replace")
    proc.err_file.close()
    return text


def temp_siblings(dst: Path) -> list[Path]:
    """The writers' temporary directories beside ``dst`` (``.NAME.*.tmp``)."""
    if not dst.parent.is_dir():
        return []
    return sorted(
        p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.") and ".tmp" in p.name
    )


def writing(dst: Path, inside: str | None = None):
    """A trigger: a temporary sibling of ``dst`` exists (holding ``inside``, when given)."""

    def seen() -> bool:
        for tmp in temp_siblings(dst):
            if inside is None or (tmp / inside).exists():
                return True
        return False

    return seen


def kill_when(proc: subprocess.Popen, trigger, delay: float = 0.0, timeout: float = 120) -> bool:
    """SIGKILL ``proc`` ``delay`` seconds after ``trigger()`` first holds (polled as fast as
    Python can); returns True if it was still running when killed, False if it had exited."""
    end = time.monotonic() + timeout
    while not trigger():
        if proc.poll() is not None:
            return False
        if time.monotonic() > end:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"no trigger within {timeout} s")
    if delay:
        time.sleep(delay)
    running = proc.poll() is None
    if running:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.err_file.close()
    return running


def check_model(path: Path) -> str | None:
    """None if ``path`` is a complete model (verifies, loads, forward pass finite), else why."""
    import mlx.core as mx
    import numpy as np

    from mlxinfer.errors import MlxInferError
    from mlxinfer.files.manifest import verify
    from mlxinfer.loading.loader import load_model

    try:
        result = verify(path)
        if not result.ok:
            return "; ".join(result.problems) or "no manifest"
        model, _ = load_model(path)
        logits = np.array(model(mx.array([[5, 17, 99, 3]])).astype(mx.float32))
    except MlxInferError as e:
        return str(e)
    return None if np.isfinite(logits).all() else "non-finite logits"


def after_kill(dst: Path) -> tuple[str, str | None]:
    """(where the kill landed, problem or None): 'after the rename' (a complete model),
    'mid-write' (debris, no model) or 'before writing' (nothing)."""
    if dst.exists():
        return "after the rename", check_model(dst)
    return ("mid-write" if temp_siblings(dst) else "before writing"), None


def rerun_outcome(landed: str, rc: int, stderr: str, dst: Path) -> str | None:
    """None if a rerun after a kill behaved (see module docstring), else why not."""
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if landed == "after the rename":
        if rc != 1 or COMPLETE not in last:
            return f"rerun over a complete model: exit {rc}, '{last}'"
    elif rc != 0:
        return f"rerun failed: exit {rc}, '{last}'"
    if temp_siblings(dst):
        return f"debris left after the rerun: {[p.name for p in temp_siblings(dst)]}"
    return check_model(dst)


def calibrate(src: Path, dst: Path) -> tuple[float, float, float]:
    """One unkilled run: (seconds to the temporary directory, to the result, to exit)."""
    t0 = time.monotonic()
    proc = start(convert_command(src, dst))
    t_tmp = t_done = None
    while proc.poll() is None:
        now = time.monotonic() - t0
        if t_tmp is None and temp_siblings(dst):
            t_tmp = now
        if t_done is None and dst.exists():
            t_done = now
    t_exit = time.monotonic() - t0
    err = stderr_of(proc)
    if proc.returncode != 0:
        raise SystemExit(f"calibration run failed (exit {proc.returncode}): {err.strip()}")
    shutil.rmtree(dst)
    return t_tmp or t_exit, t_done or t_exit, t_exit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--moments", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="work directory (default: a temp)")
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="kill-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    src = make_checkpoint(work / "hf")
    runs = [calibrate(src, work / "calibration") for _ in range(2)]
    t_exit = max(r[2] for r in runs)
    t_write = min(r[1] - r[0] for r in runs)  # the shorter, so that most such kills land in it
    print(
        f"calibration: temporary directory at {runs[0][0]:.2f}/{runs[1][0]:.2f} s, model at "
        f"{runs[0][1]:.2f}/{runs[1][1]:.2f} s, exit at {runs[0][2]:.2f}/{runs[1][2]:.2f} s",
        flush=True,
    )
    rng = random.Random(args.seed)
    landed: dict[str, int] = {}
    good = 0
    for i in range(args.moments):
        dst = work / f"out-{i}"
        proc = start(convert_command(src, dst))
        if i % 2 == 0:  # anywhere in the run
            moment = f"{(delay := rng.uniform(0, t_exit * 1.05)):.3f} s after start"
            kill_when(proc, lambda: True, delay)
        else:  # within the writing phase
            delay = rng.uniform(0, t_write)
            moment = f"{delay:.3f} s after the temporary directory appeared"
            kill_when(proc, writing(dst), delay)
        where, problem = after_kill(dst)
        landed[where] = landed.get(where, 0) + 1
        if problem is None:
            rerun = subprocess.run(convert_command(src, dst), capture_output=True, text=True)
            problem = rerun_outcome(where, rerun.returncode, rerun.stderr, dst)
        good += problem is None
        print(f"kill {i + 1}: {moment}: {where}: {problem or 'ok'}", flush=True)
        shutil.rmtree(dst, ignore_errors=True)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    where = ", ".join(f"{n} {k}" for k, n in sorted(landed.items()))
    print(
        f"{good}/{args.moments} kills left nothing or a complete, loadable model and the rerun "
        f"succeeded or said a complete model was there ({where}; seed {args.seed}; "
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs)"
    )
    return 0 if good == args.moments else 1


if __name__ == "__main__":
    sys.exit(main())
