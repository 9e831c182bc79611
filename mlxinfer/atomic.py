"""Writers that leave nothing half-written: build beside the destination, then rename."""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def writing_dir(dst: Path) -> Iterator[Path]:
    """Yield a fresh sibling directory to fill; on success it replaces ``dst`` (absent or empty).

    On any error the sibling is removed and ``dst`` is untouched. The sibling is
    made with ``mkdir``, so it gets the umask's ordinary mode (``mkdtemp``'s 0700
    would stick to the result).
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = (
        dst.parent / f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp"
    )  # same filesystem: rename is atomic
    tmp.mkdir()
    try:
        yield tmp
        if dst.exists():
            dst.rmdir()  # empty: callers refuse a non-empty destination first
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
