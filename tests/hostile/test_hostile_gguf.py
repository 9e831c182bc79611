"""Hostile GGUF files end in our one-line error naming the key or tensor, never a crash.

Each file is a working tiny llama (tests/gguf_bytes.py, imported successfully by the first
test) with one thing broken, in the ways peers' GGUF readers were broken (CVE-2025-53630,
CVE-2026-27940, CVE-2025-0317, CVE-2024-8063): the container's rules (alignment, dimensions,
sizes, offsets, duplicates, nesting) and the metadata that becomes config.json (types, ranges,
divisibility, token ids).
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import textwrap

import pytest
from gguf_bytes import (
    ARRAY,
    F32,
    GGML_F32,
    GGUF,
    I32,
    STRING,
    TOKENS,
    U8,
    U32,
    U64,
    Raw,
    Tensor,
    gguf_bytes,
    gguf_file,
    tiny_llama,
)

from mlxinfer.errors import ConfigError, TokenizerError, WeightsError
from mlxinfer.gguf import import_gguf, read_gguf_header


def header_error(tmp_path, g: GGUF, **counts) -> str:
    """read_gguf_header's WeightsError message for this file (one line, naming the file)."""
    path = tmp_path / "hostile.gguf"
    data = gguf_bytes(g, **counts)
    path.write_bytes(data)
    with pytest.raises(WeightsError) as e:
        read_gguf_header(path, data)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def import_error(tmp_path, g: GGUF, kind=ConfigError) -> str:
    """import_gguf's error message for this file: ``kind``, one line, nothing left behind."""
    path = gguf_file(tmp_path / "hostile.gguf", g)
    with pytest.raises(kind) as e:
        import_gguf(path, tmp_path / "out")
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    assert not (tmp_path / "out").exists()
    return msg


def as_arch(g: GGUF, arch: str, **extra) -> GGUF:
    """The tiny file's metadata under another architecture's prefix, plus ``extra`` keys."""
    g.kvs = [(k.replace("llama.", f"{arch}.", 1), c, v) for k, c, v in g.kvs]
    g.set("general.architecture", STRING, arch)
    for key, (code, value) in extra.items():
        g.set(f"{arch}.{key}", code, value)
    return g


# ---------------------------------------------------------------------------
# the container


@pytest.mark.parametrize("depth", [3, 5000])
def test_arrays_nested_too_deep_are_refused(tmp_path, depth):
    """Old code: depth 3 read without complaint; depth 5000 a RecursionError. Two levels
    (an array of arrays) is the most the reader takes; llama.cpp takes one."""
    pairs = tiny_llama().set("general.pairs", ARRAY, (ARRAY, [(U8, [1, 2]), (U8, [3])]))
    md, _ = read_gguf_header(tmp_path / "pairs.gguf", gguf_bytes(pairs))
    assert [list(a) for a in md["general.pairs"]] == [[1, 2], [3]]
    # depth - 1 arrays each holding one array, then one holding a uint8
    value = struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQB", U8, 1, 7)
    g = tiny_llama().set("general.nested", ARRAY, Raw(value))
    assert "GGUF key general.nested: arrays nested more than 2 deep" in header_error(tmp_path, g)


@pytest.mark.parametrize("where", ["value", "array item"])
def test_unknown_value_type_names_the_key(tmp_path, where):
    """Old code: a WeightsError that named only a byte position."""
    g = tiny_llama()
    data = gguf_bytes(g.set("general.odd", U32, 7))
    # the key's type code follows its name: 13, or an array (9) of items of type 13
    key = (11).to_bytes(8, "little") + b"general.odd"
    at = data.index(key) + len(key)
    if where == "value":
        data = data[:at] + (13).to_bytes(4, "little") + data[at + 4 :]
    else:
        data = data[:at] + (9).to_bytes(4, "little") + (13).to_bytes(4, "little") + data[at + 4 :]
    path = tmp_path / "odd.gguf"
    with pytest.raises(WeightsError, match=f"GGUF key general.odd: unknown {where} type 13"):
        read_gguf_header(path, data)


@pytest.mark.parametrize(
    "code, value, found",
    [
        (U32, 0, "expected a power of two, found 0"),  # old code: ZeroDivisionError
        (U32, 48, "expected a power of two, found 48"),  # old code: read
        (F32, 32.0, "expected a uint32, found a float32"),  # old code: read
        (U64, 32, "expected a uint32, found a uint64"),  # old code: read
        (STRING, "32", "expected a uint32, found a string"),  # old code: read
    ],
)
def test_alignment_must_be_a_uint32_power_of_two(tmp_path, code, value, found):
    g = tiny_llama().set("general.alignment", code, value)
    assert f"general.alignment: {found}" in header_error(tmp_path, g)


def test_a_key_given_twice_is_refused(tmp_path):
    """Old code: the second value silently won."""
    g = tiny_llama()
    g.kvs.append(("llama.attention.head_count", U32, 4))
    msg = header_error(tmp_path, g)
    assert "GGUF key llama.attention.head_count appears twice" in msg


def test_a_tensor_named_twice_is_refused(tmp_path):
    """Old code: the second entry silently won."""
    g = tiny_llama()
    t = g.tensor("output_norm.weight")
    g.tensors.append(Tensor(t.name, t.dims, t.type_code, t.data))
    assert "tensor output_norm.weight appears twice" in header_error(tmp_path, g)


def test_more_than_four_dimensions_are_refused(tmp_path):
    """Old code: read (ggml has at most 4)."""
    g = tiny_llama()
    t = g.tensor("output_norm.weight")
    t.dims = (*t.dims, 1, 1, 1, 1)
    msg = header_error(tmp_path, g)
    assert "tensor output_norm.weight has 5 dimensions; expected 1 to 4" in msg


def test_a_zero_dimension_is_refused(tmp_path):
    """Old code: read as an empty tensor."""
    g = tiny_llama()
    g.tensor("blk.0.attn_q.weight").dims = (32, 0)
    msg = header_error(tmp_path, g)
    assert "tensor blk.0.attn_q.weight has dimensions [32, 0]; expected each at least 1" in msg


def test_dimensions_whose_product_overflows_int64_are_refused(tmp_path):
    """2**32 * 2**32 is 0 in int64: old code read a 0-byte tensor of 2**64 floats."""
    g = tiny_llama()
    g.tensor("output_norm.weight").dims = (2**32, 2**32)
    msg = header_error(tmp_path, g)
    assert "truncated GGUF: tensor output_norm.weight (F32, shape (4294967296, 4294967296))" in msg
    assert int(re.search(r"needs bytes up to (\d+)", msg)[1]) > 4 * 2**64  # exact, not wrapped


def test_importing_overflowing_dimensions_fails_cleanly_in_a_subprocess(tmp_path):
    """The whole import in a fresh interpreter (old code handed the wrapped size to numpy)."""
    g = tiny_llama()
    g.tensor("blk.0.attn_q.weight").dims = (2**33, 2**31)
    path = gguf_file(tmp_path / "big.gguf", g)
    code = textwrap.dedent(f"""
        from mlxinfer.errors import MlxInferError
        from mlxinfer.gguf import import_gguf
        try:
            import_gguf({str(path)!r}, {str(tmp_path / "out")!r})
        except MlxInferError as e:
            print(type(e).__name__, e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("WeightsError ") and "tensor blk.0.attn_q.weight" in r.stdout


def test_a_misaligned_offset_is_refused(tmp_path):
    """Old code: read from wherever the offset pointed."""
    g = tiny_llama()
    g.tensor("output_norm.weight").offset = 100_000 + 8  # past every other tensor, 8 off
    g.tensors.append(Tensor("pad", (1,), GGML_F32, b"\0" * 4, offset=100_000 + 256))
    msg = header_error(tmp_path, g)
    assert "tensor output_norm.weight offset 100008 is not a multiple of the alignment 32" in msg


def test_overlapping_tensors_are_refused(tmp_path):
    """Old code: read two tensors from the same bytes."""
    g = tiny_llama()
    g.tensor("blk.0.ffn_norm.weight").offset = 0  # the first bytes of token_embd
    msg = header_error(tmp_path, g)
    assert "tensor blk.0.ffn_norm.weight starts at byte" in msg
    assert "inside tensor token_embd.weight" in msg


def test_architecture_must_be_a_string(tmp_path):
    """Old code: ValueError (a numpy array compared against the supported names)."""
    g = tiny_llama().set("general.architecture", ARRAY, (U8, list(b"llama")))
    msg = header_error(tmp_path, g)
    assert "general.architecture: expected a string, found a uint8 array" in msg


# ---------------------------------------------------------------------------
# metadata -> config.json


@pytest.mark.parametrize(
    "key, code, value, found",
    [  # the old code's outcome in each comment
        ("attention.head_count", U32, 0, "found 0"),  # ZeroDivisionError
        ("attention.head_count_kv", U32, 0, "found 0"),  # imported
        ("attention.head_count_kv", U32, 3, "found 3"),  # imported: 2 heads, 3 kv heads
        ("embedding_length", STRING, "32", "found a string"),  # imported via int("32")
        ("embedding_length", I32, -32, "found -32"),  # imported
        ("embedding_length", U32, 64, "found 64"),  # imported; token_embd is 32 wide
        ("block_count", U64, 2**40, f"found {2**40}"),  # imported
        ("block_count", F32, 1.0, "found a float"),  # imported via int(1.0)
        ("context_length", U32, 0, "found 0"),  # imported
        ("feed_forward_length", ARRAY, (U32, [32]), "found an array"),  # imported via int(array)
        ("attention.key_length", U32, 0, "found 0"),  # imported with head_dim 0
        ("attention.layer_norm_rms_epsilon", STRING, "x", "found a string"),  # ValueError
        ("attention.layer_norm_rms_epsilon", F32, -1.0, "found -1.0"),  # imported
        ("rope.freq_base", F32, float("nan"), "found nan"),  # imported
        ("vocab_size", U32, 1000, "found 1000"),  # imported; token_embd has 30 rows
    ],
)
def test_config_metadata_of_the_wrong_type_or_range_names_the_key(
    tmp_path, key, code, value, found
):
    g = tiny_llama().set(f"llama.{key}", code, value)
    msg = import_error(tmp_path, g)
    assert f"llama.{key}" in msg and found in msg


def test_q_rows_that_do_not_split_into_heads_are_refused_before_a_float_import(tmp_path):
    """llama.cpp's q/k row order is undone head by head. Old code: ValueError from numpy's
    reshape on the ``--dtype`` path (the quantized path named the tensor but not the file)."""
    g = tiny_llama()
    q = g.tensor("blk.0.attn_q.weight")
    q.dims, q.data = (32, 34), q.data + q.data[: 2 * 32 * 4]  # 34 rows for 2 heads
    path = gguf_file(tmp_path / "rows.gguf", g)
    with pytest.raises(WeightsError) as e:
        import_gguf(path, tmp_path / "out", dtype="float32")
    msg = str(e.value)
    assert str(path) in msg and "tensor blk.0.attn_q.weight has 34 rows" in msg


def test_linear_rope_scaling_without_a_factor_is_refused(tmp_path):
    """Old code: imported with factor NaN. (A needed key that is absent is a WeightsError,
    as tests/gguf/test_gguf.py has it for gemma3.attention.sliding_window.)"""
    g = tiny_llama().set("llama.rope.scaling.type", STRING, "linear")
    msg = import_error(tmp_path, g, kind=WeightsError)
    assert "GGUF metadata lacks llama.rope.scaling.factor" in msg


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3moe", "gpt-oss"])
def test_zero_heads_are_a_config_error_in_every_architecture(tmp_path, arch):
    """Old code: ZeroDivisionError in every one (hidden // heads)."""
    extra = {"attention.sliding_window": (U32, 4)}
    if arch in ("qwen3moe", "gpt-oss"):
        extra.update(expert_count=(U32, 2), expert_used_count=(U32, 1),
                     expert_feed_forward_length=(U32, 16))  # fmt: skip
    g = as_arch(tiny_llama(), arch, **extra).set(f"{arch}.attention.head_count", U32, 0)
    msg = import_error(tmp_path, g)
    assert f"{arch}.attention.head_count: expected an integer in [1, " in msg and "found 0" in msg


def test_gemma3_sliding_window_pattern_zero_is_refused(tmp_path):
    """Old code: ZeroDivisionError ((i + 1) % pattern)."""
    g = as_arch(tiny_llama(), "gemma3", **{"attention.sliding_window": (U32, 4),
                                           "attention.sliding_window_pattern": (U32, 0)})  # fmt: skip
    assert "gemma3.attention.sliding_window_pattern" in import_error(tmp_path, g)


@pytest.mark.parametrize(
    "key, value", [("expert_count", 0), ("expert_used_count", 3)]
)  # old code: imported (no experts; 3 of 2 experts per token)
def test_expert_counts_are_checked(tmp_path, key, value):
    extra = {"expert_count": (U32, 2), "expert_used_count": (U32, 1),
             "expert_feed_forward_length": (U32, 16)}  # fmt: skip
    g = as_arch(tiny_llama(), "qwen3moe", **extra).set(f"qwen3moe.{key}", U32, value)
    assert f"qwen3moe.{key}" in import_error(tmp_path, g)


def test_more_tokens_than_embedding_rows_is_refused(tmp_path):
    """Old code: imported; the extra tokens' ids index past the embedding."""
    g = tiny_llama().drop("llama.vocab_size")
    g.set("tokenizer.ggml.tokens", ARRAY, (STRING, TOKENS + ["zz"]))
    g.set("tokenizer.ggml.token_type", ARRAY, (I32, [3, 3] + [1] * (len(TOKENS) - 1)))
    msg = import_error(tmp_path, g)
    assert "tokenizer.ggml.tokens" in msg and f"{len(TOKENS) + 1}" in msg


def test_a_bos_id_past_the_embedding_is_refused(tmp_path):
    """BOS is fed to the model. Old code: imported; generation then read past the embedding."""
    g = tiny_llama().set("tokenizer.ggml.bos_token_id", U32, 10**6)
    msg = import_error(tmp_path, g)
    assert "tokenizer.ggml.bos_token_id" in msg and "found 1000000" in msg


def test_an_eos_id_past_the_embedding_is_dropped_with_a_warning(tmp_path):
    """EOS is only compared against, so the file still imports (and loads), without it.
    Old code: config.json carried eos_token_id 1000000. (Every other case here differs from
    this file in one key or tensor: this is also their control.)"""
    from mlxinfer.loading.loader import load_model

    g = tiny_llama().set("tokenizer.ggml.eos_token_id", U32, 10**6)
    with pytest.warns(RuntimeWarning, match="tokenizer.ggml.eos_token_id"):
        import_gguf(gguf_file(tmp_path / "eos.gguf", g), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "eos_token_id" not in config and config["bos_token_id"] == 0
    assert config["vocab_size"] == len(TOKENS)
    load_model(tmp_path / "out")


# ---------------------------------------------------------------------------
# the vocabulary


@pytest.mark.parametrize(
    "key, code, value",
    [  # the old code's outcome in each comment
        ("tokenizer.ggml.model", ARRAY, (U8, list(b"gpt2"))),  # ValueError
        ("tokenizer.ggml.tokens", None, None),  # KeyError
        ("tokenizer.ggml.tokens", ARRAY, (U32, list(range(len(TOKENS))))),  # TypeError
        ("tokenizer.ggml.merges", ARRAY, (U32, [1, 2])),  # AttributeError
        ("tokenizer.ggml.merges", ARRAY, (STRING, ["a zz"])),  # tokenizers' Exception
        ("tokenizer.ggml.merges", ARRAY, (STRING, ["b c"])),  # tokenizers' Exception ("bc")
        ("tokenizer.ggml.token_type", ARRAY, (STRING, ["1"] * len(TOKENS))),  # imported
        ("tokenizer.ggml.token_type", ARRAY, (I32, [1])),  # imported (zip cut it short)
        ("tokenizer.chat_template", U32, 1),  # imported (a template of 1)
    ],
)
def test_vocabulary_metadata_of_the_wrong_type_names_the_key(tmp_path, key, code, value):
    g = tiny_llama()
    g = g.drop(key) if code is None else g.set(key, code, value)
    assert key in import_error(tmp_path, g, kind=TokenizerError)


def test_a_vocabulary_that_panics_tokenizers_is_our_error(tmp_path):
    """Single-character tokens and a merge whose result is no token: tokenizers 0.22 panics
    (a pyo3 PanicException, a BaseException). Old code: the panic escaped."""
    g = tiny_llama().set("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "b", "c"]))
    g.set("tokenizer.ggml.token_type", ARRAY, (I32, [1, 1, 1]))
    g.set("tokenizer.ggml.merges", ARRAY, (STRING, ["a b"]))
    msg = import_error(tmp_path, g, kind=TokenizerError)
    assert "tokenizer.ggml.merges" in msg and "'a b'" in msg
