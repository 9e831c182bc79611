"""A GGUF file written byte by byte, for the hostile-file tests and the GGUF fuzz target.

The ``gguf`` package's writer refuses most of what these tests need (a key twice, arrays of
arrays, a zero dimension, a misaligned offset), so the format is written here from its spec
(llama.cpp's ``docs/gguf.md``): header, key/value pairs, tensor directory, aligned data.

``tiny_llama()`` is a complete one-layer llama with a byte-level BPE vocabulary that
``import_gguf`` accepts; a test swaps one key's value or one tensor's directory entry and
writes the file with ``gguf_file()``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

# value type codes (gguf.md: GGUF_TYPE_*)
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?",
        U64: "Q", I64: "q", F64: "d"}  # fmt: skip
# tensor type codes (ggml_type)
GGML_F32, GGML_Q8_0 = 0, 8


class Raw(bytes):
    """A value's bytes as they stand (after its type code)."""


def value_bytes(code: int, value) -> bytes:
    """One metadata value: a scalar, a string, ``(item code, [items])`` for an array, or Raw."""
    if isinstance(value, Raw):
        return value
    if code == STRING:
        raw = value.encode("utf-8") if isinstance(value, str) else value
        return struct.pack("<Q", len(raw)) + raw
    if code == ARRAY:
        item, items = value
        return struct.pack("<IQ", item, len(items)) + b"".join(value_bytes(item, x) for x in items)
    return struct.pack("<" + _FMT[code], value)


def key_value_bytes(key: str, code: int, value) -> bytes:
    return value_bytes(STRING, key) + struct.pack("<I", code) + value_bytes(code, value)


@dataclass
class Tensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: the row length first
    type_code: int
    data: bytes
    offset: int | None = None  # relative to the data section; None: the next aligned place


@dataclass
class GGUF:
    kvs: list[tuple[str, int, object]] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    version: int = 3
    alignment: int = 32  # where the writer puts the data section and tensors (not a key)

    def set(self, key: str, code: int, value) -> GGUF:
        """Replace (or add) one key's value."""
        self.kvs = [kv for kv in self.kvs if kv[0] != key] + [(key, code, value)]
        return self

    def drop(self, key: str) -> GGUF:
        self.kvs = [kv for kv in self.kvs if kv[0] != key]
        return self

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def gguf_bytes(g: GGUF, *, n_tensors: int | None = None, n_kv: int | None = None) -> bytes:
    """The file; ``n_tensors`` / ``n_kv`` override the counts the header claims."""
    offsets, pos = [], 0
    for t in g.tensors:
        offset = _align(pos, g.alignment) if t.offset is None else t.offset
        offsets.append(offset)
        pos = max(pos, offset + len(t.data))
    head = b"GGUF" + struct.pack(
        "<IQQ",
        g.version,
        len(g.tensors) if n_tensors is None else n_tensors,
        len(g.kvs) if n_kv is None else n_kv,
    )
    head += b"".join(key_value_bytes(*kv) for kv in g.kvs)
    for t, offset in zip(g.tensors, offsets):
        head += value_bytes(STRING, t.name) + struct.pack("<I", len(t.dims))
        head += struct.pack(f"<{len(t.dims)}Q", *t.dims) + struct.pack("<IQ", t.type_code, offset)
    data = bytearray(pos)
    for t, offset in zip(g.tensors, offsets):
        data[offset : offset + len(t.data)] = t.data
    return head + bytes(_align(len(head), g.alignment) - len(head)) + bytes(data)


def gguf_file(path, g: GGUF, **counts):
    path.write_bytes(gguf_bytes(g, **counts))
    return path


# ---------------------------------------------------------------------------
# a complete tiny llama

HIDDEN, N_HEADS, N_KV, HEAD_DIM, FFN = 32, 2, 1, 16, 32
BYTE_TOKENS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
TOKENS = ["<s>", "</s>", *BYTE_TOKENS, "ab", "abc"]
MERGES = ["a b", "ab c"]


def _f32(shape: tuple[int, ...], rng) -> Tensor:
    """(rows, cols) floats -> a tensor entry (GGUF dims reversed)."""
    return Tensor(
        "", tuple(reversed(shape)), GGML_F32, rng.standard_normal(shape).astype("<f4").tobytes()
    )


def tiny_llama() -> GGUF:
    rng = np.random.default_rng(0)
    g = GGUF()
    g.kvs = [
        ("general.architecture", STRING, "llama"),
        ("general.alignment", U32, 32),
        ("llama.block_count", U32, 1),
        ("llama.context_length", U32, 64),
        ("llama.embedding_length", U32, HIDDEN),
        ("llama.feed_forward_length", U32, FFN),
        ("llama.attention.head_count", U32, N_HEADS),
        ("llama.attention.head_count_kv", U32, N_KV),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("llama.rope.freq_base", F32, 10000.0),
        ("llama.vocab_size", U32, len(TOKENS)),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, "gpt-2"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, TOKENS)),
        ("tokenizer.ggml.token_type", ARRAY, (I32, [3, 3] + [1] * (len(TOKENS) - 2))),
        ("tokenizer.ggml.merges", ARRAY, (STRING, MERGES)),
        ("tokenizer.ggml.bos_token_id", U32, 0),
        ("tokenizer.ggml.eos_token_id", U32, 1),
    ]
    shapes = {
        "token_embd.weight": (len(TOKENS), HIDDEN),
        "blk.0.attn_q.weight": (N_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_k.weight": (N_KV * HEAD_DIM, HIDDEN),
        "blk.0.attn_v.weight": (N_KV * HEAD_DIM, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, N_HEADS * HEAD_DIM),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "output_norm.weight": (HIDDEN,),
    }
    for name, shape in shapes.items():
        t = _f32(shape, rng)
        t.name = name
        g.tensors.append(t)
    return g
