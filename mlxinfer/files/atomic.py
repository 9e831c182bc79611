"""Writers that leave nothing half-written: build beside the destination, flush, then rename.

A SIGKILL or a power cut at any moment leaves either the old state (nothing, or the
previous file) or the complete new one. The pieces:

* every file written is fsynced, then its directory, before the rename; the parent
  directory after it, so the rename itself is on disk;
* work happens in a sibling named ``.NAME.<host>-<pid>-<random>.tmp`` (same file
  system: ``rename`` is atomic); the writer's host (a hash of its name) and pid are its
  lock. A killed writer leaves that sibling behind; the next write to the same
  destination removes every sibling of this host whose pid is no longer alive
  (``os.kill(pid, 0)``) and keeps those of live writers. A reused pid only delays the
  cleanup until that process exits. Another host's (a shared network or container
  volume, where its pids mean nothing here) is removed only once nothing in it has
  changed for a day.

On macOS ``fsync`` flushes to the drive but not through its cache; ``F_FULLFSYNC`` is
used there when the file system supports it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import MlxInferError


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's data and metadata to the disk."""
    fd = os.open(path, os.O_RDONLY)  # a directory opens read-only too (POSIX)
    try:
        if sys.platform == "darwin":
            import fcntl

            try:
                fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
                return
            except OSError:
                pass  # not every file system has it; plain fsync below
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """fsync a directory; file systems that cannot (some network and FUSE mounts) are skipped."""
    try:
        fsync_path(path)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES, errno.EPERM):
            raise


FOREIGN_DEBRIS_AGE_S = 24 * 3600  # another host's temporary sibling, untouched this long: debris


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _sibling(dst: Path, suffix: str = "") -> Path:
    """``.NAME.<host>-<pid>-<random>.tmp`` beside ``dst`` (``suffix`` after it, e.g.
    ``.safetensors``, for writers that append their own when it is missing)."""
    tag = f"{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return dst.parent / f".{dst.name}.{tag}.tmp{suffix}"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    except OSError:
        return True  # cannot tell: keep its files
    return True


def _last_change(entry: os.DirEntry) -> float:
    """The newest mtime of a file, or of a directory and what it holds."""
    newest = entry.stat(follow_symlinks=False).st_mtime
    if entry.is_dir(follow_symlinks=False):
        for here, _, files in os.walk(entry.path):
            for name in [*files, "."]:
                try:
                    newest = max(newest, os.stat(os.path.join(here, name)).st_mtime)
                except OSError:
                    pass
    return newest


def _abandoned(entry: os.DirEntry, this_host: bool, pid: int) -> bool:
    """Whether a temporary sibling's writer is gone: its pid is dead (this host), or nothing in
    it changed for a day (another host's, whose pids cannot be checked from here)."""
    if this_host:
        return not _alive(pid)
    try:
        return time.time() - _last_change(entry) >= FOREIGN_DEBRIS_AGE_S
    except OSError:
        return False


def clear_debris(dst: Path) -> list[Path]:
    """Remove the temporary siblings of ``dst`` left by writers that are no longer running;
    returns what was removed."""
    pattern = re.compile(
        rf"^\.{re.escape(dst.name)}\.([0-9a-f]{{8}})-(\d+)-[0-9a-f]{{8}}\.tmp(\.\w+)?$"
    )
    removed = []
    try:
        entries = list(os.scandir(dst.parent))
    except OSError:
        return removed
    host = _host()
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None or not _abandoned(entry, m.group(1) == host, int(m.group(2))):
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, deepest first, ``root`` last."""
    dirs = []
    for here, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(here) / name)
        dirs.append(Path(here))
    for d in reversed(dirs):
        _fsync_dir(d)


@contextmanager
def writing_dir(dst: Path) -> Iterator[Path]:
    """Yield a fresh sibling directory to fill; on success it replaces ``dst`` (absent or empty).

    On any error the sibling is removed and ``dst`` is untouched. Before the rename every
    file and directory in it is fsynced; after it, the parent. Debris of killed writers to
    the same ``dst`` is removed first. The sibling is made with ``mkdir``, so it gets the
    umask's ordinary mode (``mkdtemp``'s 0700 would stick to the result).

    Raises:
      MlxInferError: ``dst`` was filled by someone else meanwhile (the work is dropped).
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    clear_debris(dst)
    tmp = _sibling(dst)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        try:
            os.replace(tmp, dst)  # POSIX: replaces an empty directory in one step
        except OSError:
            if not dst.exists():
                raise
            if not dst.is_dir() or any(dst.iterdir()):
                raise MlxInferError(
                    f"{dst}: another process wrote this destination meanwhile; "
                    "kept theirs, dropped this one"
                ) from None
            dst.rmdir()  # an empty directory where rename will not replace one (Windows)
            os.replace(tmp, dst)
        _fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def writing_file(dst: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``dst`` to write; on success it is fsynced and renamed onto
    ``dst``, then the directory is fsynced. On error it is removed and ``dst`` is untouched.

    The temporary path ends with ``dst``'s suffix (``mx.save_safetensors`` appends
    ``.safetensors`` to a path without it).
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    clear_debris(dst)
    tmp = _sibling(dst, dst.suffix)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, dst)
        _fsync_dir(dst.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(dst: Path, data: bytes) -> None:
    """Replace ``dst`` with ``data`` atomically (see :func:`writing_file`)."""
    with writing_file(dst) as tmp:
        tmp.write_bytes(data)


def write_text(dst: Path, text: str) -> None:
    """Replace ``dst`` with ``text`` (UTF-8) atomically (see :func:`writing_file`)."""
    write_bytes(dst, text.encode("utf-8"))


@contextmanager
def scratch_dir(parent: Path, name: str) -> Iterator[Path]:
    """A private working directory ``parent/.NAME.<host>-<pid>-<random>.tmp``, removed on exit; those
    of killed processes (same ``name``) are removed on entry."""
    anchor = Path(parent) / name
    Path(parent).mkdir(parents=True, exist_ok=True)
    clear_debris(anchor)
    work = _sibling(anchor)
    work.mkdir()
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def discard_dir(path: Path) -> None:
    """Remove a directory so that it disappears at once: renamed to a debris sibling first, so a
    kill during the removal leaves debris for :func:`clear_debris`, never a half-deleted ``path``."""
    path = Path(path)
    doomed = _sibling(path)
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return
    _fsync_dir(path.parent)
    if doomed.is_dir() and not doomed.is_symlink():
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        doomed.unlink(missing_ok=True)
