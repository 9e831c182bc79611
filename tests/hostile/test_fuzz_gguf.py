"""Fuzz target: mutated GGUF files end in success or our own error, within a time bound.

Seeded from two small working files: the byte-written tiny llama (tests/gguf_bytes.py, F32)
and the suite's tiny llama written by the ``gguf`` package (tests/gguf/test_gguf.py: Q4_0, Q4_1,
Q8_0, F16, BF16, F32). Each example rewrites header fields (counts, lengths, type codes,
dimensions, offsets) with boundary values, flips bytes, truncates or splices the file, then
reads the header (``read_gguf_header``) and imports it (``import_gguf``): both must end in
success or an ``MlxInferError`` within ``BOUND_S`` seconds. Pure-Python parsing cannot
segfault, and the reader checks every size before numpy or MLX sees one, so this runs
in-process.

``MLXINFER_FUZZ_EXAMPLES`` sets the examples per target (``tools/fuzz.py`` runs thousands);
``MLXINFER_FUZZ_RANDOM=1`` draws new ones instead of the suite's fixed set.
"""

from __future__ import annotations

import functools
import os
import signal
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from gguf_bytes import gguf_bytes, tiny_llama
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mlxinfer.errors import MlxInferError
from mlxinfer.gguf import import_gguf, read_gguf_header

EXAMPLES = int(os.environ.get("MLXINFER_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("MLXINFER_FUZZ_RANDOM") != "1",
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BOUND_S = 20.0  # a tiny file is read in milliseconds and imported in ~50 ms


# ---------------------------------------------------------------------------
# seeds and where their header fields are


def _fields(data: bytes) -> list[tuple[int, int]]:
    """(position, width) of every count, length, type code, dimension and offset in a
    well-formed file's header: the fields a mutation rewrites."""
    fields, pos = [(4, 4), (8, 8), (16, 8)], 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def u(fmt):
        nonlocal pos
        fields.append((pos, struct.calcsize(fmt)))
        pos += struct.calcsize(fmt)
        return struct.unpack_from("<" + fmt, data, pos - struct.calcsize(fmt))[0]

    def string():
        nonlocal pos
        length = u("Q")
        pos += length

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(code):
        nonlocal pos
        if code == 8:
            string()
        elif code == 9:
            item, count = u("I"), u("Q")
            if item in (8, 9):
                for _ in range(count):
                    value(item)
            else:  # a numeric array: its items are data, not fields
                pos += count * sizes[item]
        elif sizes[code] in (4, 8):  # numeric scalars are fields too (alignment, token ids, ...)
            u({4: "I", 8: "Q"}[sizes[code]])
        else:
            pos += sizes[code]

    for _ in range(n_kv):
        string()
        value(u("I"))
    for _ in range(n_tensors):
        string()
        for _ in range(u("I")):
            u("Q")
        u("I")
        u("Q")
    return fields


@functools.cache
def seeds() -> list[tuple[bytes, list[tuple[int, int]]]]:
    """The seed files and their header fields; each imports, so that mutations reach past
    the header into the config, the vocabulary and the tensors."""
    from gguf_tiny import write_tiny_gguf

    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_gguf(Path(tmp) / "q.gguf")
        files = [gguf_bytes(tiny_llama()), (Path(tmp) / "q.gguf").read_bytes()]
        for i, data in enumerate(files):
            (Path(tmp) / f"{i}.gguf").write_bytes(data)
            import_gguf(Path(tmp) / f"{i}.gguf", Path(tmp) / f"out{i}")
    return [(data, _fields(data)) for data in files]


# ---------------------------------------------------------------------------
# mutations

_BOUNDARY = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 31, 32, 33, 48, 64, 255, 256, 2**16,
             2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**33, 2**62, 2**63 - 1, 2**63, 2**64 - 1]  # fmt: skip


@st.composite
def mutated(draw) -> bytes:
    data, fields = draw(st.sampled_from(seeds()))
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        if not data:
            break
        op = draw(st.sampled_from(["field", "field", "field", "byte", "truncate", "splice"]))
        if op == "field":  # a header field set to a boundary value (or near the original)
            pos, width = draw(st.sampled_from(fields))
            old = int.from_bytes(data[pos : pos + width], "little")
            new = draw(
                st.sampled_from(_BOUNDARY + [len(data), len(data) - 24])
                | st.integers(max(0, old - 4), old + 4)
                | st.integers(0, 2 ** (8 * width) - 1)
            )
            data[pos : pos + width] = (new % 2 ** (8 * width)).to_bytes(width, "little")
        elif op == "byte":
            pos = draw(st.integers(0, len(data) - 1))
            data[pos] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif len(data) > 1:  # splice: a run of bytes copied elsewhere (keys, arrays, tensors)
            a, b = sorted(draw(st.lists(st.integers(0, len(data)), min_size=2, max_size=2)))
            at = draw(st.integers(0, len(data)))
            data[at:at] = data[a : a + min(b - a, 256)]
    return bytes(data)


class _TooSlow(Exception):
    pass


@contextmanager
def time_bound(seconds: float):
    """Fail an example that runs longer than ``seconds`` (SIGALRM: main thread, POSIX)."""

    def stop(signum, frame):
        raise _TooSlow(f"took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------
# targets


@FUZZ
@given(mutated())
def test_fuzz_gguf_header(data):
    """read_gguf_header: success or MlxInferError, and what it returns is consistent."""
    with time_bound(BOUND_S):
        try:
            _, tensors = read_gguf_header(Path("fuzz.gguf"), data)
        except MlxInferError as e:
            assert "\n" not in str(e)
            event(type(e).__name__)
            return
    event("read")
    ends = sorted((t.offset, t.offset + t.nbytes) for t in tensors.values())
    assert all(end <= len(data) for _, end in ends)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))
    assert all(1 <= len(t.shape) <= 4 and min(t.shape) >= 1 for t in tensors.values())


@FUZZ
@given(mutated())
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # ids past the embedding: dropped, said so
def test_fuzz_gguf_import(data):
    """import_gguf: a model directory or MlxInferError (and nothing left behind)."""
    with tempfile.TemporaryDirectory() as tmp, time_bound(BOUND_S):
        path = Path(tmp) / "fuzz.gguf"
        path.write_bytes(data)
        try:
            import_gguf(path, Path(tmp) / "out")
        except MlxInferError as e:
            assert "\n" not in str(e)
            event(type(e).__name__)
            return
        event("imported")
        assert (Path(tmp) / "out" / "config.json").is_file()
