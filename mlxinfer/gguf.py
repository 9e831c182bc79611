"""Import a llama.cpp GGUF file into an mlxinfer model directory.

``import_gguf(src, dst)`` reads the GGUF container itself (no ``gguf`` package at
run time), then writes the same HF-like directory ``convert`` produces:
``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``,
``generation_config.json``.

Supported: architecture ``llama``; tensor types F32, F16, BF16, Q4_0, Q4_1,
Q8_0; a ``gpt2`` (byte-level BPE) vocabulary.

The block types map onto MLX affine quantization (group 32) exactly, so no
weight is rounded twice:

    Q4_1  x = d*q + m,         q in [0, 15]      -> bits 4, scale d, bias m
    Q4_0  x = d*(q - 8)                           -> bits 4, scale d, bias -8d
    Q8_0  x = d*q,             q in [-128, 127]   -> bits 8, q+128, scale d, bias -128d

(-8d and -128d are exact in float16: multiplying by a power of two only moves
the exponent.) A file may mix types -- SmolLM2's Q4_1 file keeps its embedding
in Q8_0 -- so the ``quantization`` record in config.json carries the most
common setting at the top level plus one entry per module that differs, keyed
by module path (``{"bits": 8, "group_size": 32, "mode": "affine"}``, or
``false`` for a module left in floating point).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from .errors import MlxInferError, WeightsError
from .gguf_vocab import build_tokenizer

GROUP_SIZE = 32  # every supported block type holds 32 weights

# ---------------------------------------------------------------------------
# Reading the container

# GGUF metadata value types: code -> struct format (None: string / array).
_VALUE_FORMATS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
    8: None, 9: None, 10: "Q", 11: "q", 12: "d",
}
_NUMPY_OF_FORMAT = {
    "B": np.uint8, "b": np.int8, "H": np.uint16, "h": np.int16, "I": np.uint32,
    "i": np.int32, "f": np.float32, "?": np.bool_, "Q": np.uint64, "q": np.int64,
    "d": np.float64,
}

# ggml tensor types we convert: code -> (name, weights per block, bytes per block)
_TENSOR_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
}
# ...and the names of the others, for error messages only.
_OTHER_TYPE_NAMES = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K",
    13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
    18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols); GGUF stores it reversed
    type_name: str
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    """Sequential little-endian reads from a buffer; running off its end is a truncated file."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def span(self, n: int) -> slice:
        """The next ``n`` bytes, bounds-checked; moves past them."""
        end = self.pos + n
        if end > len(self.buf):
            raise WeightsError(f"{self.path}: truncated GGUF header: needs byte {end}, file has {len(self.buf)}")
        span, self.pos = slice(self.pos, end), end
        return span

    def take(self, fmt: str):
        return struct.unpack("<" + fmt, self.buf[self.span(struct.calcsize("<" + fmt))])[0]

    def string(self) -> str:
        return self.buf[self.span(self.take("Q"))].decode("utf-8", errors="replace")

    def value(self, code: int):
        if code == 8:
            return self.string()
        if code == 9:
            item, count = self.take("I"), self.take("Q")
            fmt = _VALUE_FORMATS.get(item)
            if fmt is not None:  # numeric array: one numpy read
                dtype = np.dtype(_NUMPY_OF_FORMAT[fmt]).newbyteorder("<")
                return np.frombuffer(self.buf[self.span(count * dtype.itemsize)], dtype)
            return [self.value(item) for _ in range(count)]
        if code not in _VALUE_FORMATS:
            raise WeightsError(f"{self.path}: unknown GGUF metadata value type {code} at byte {self.pos - 4}")
        return self.take(_VALUE_FORMATS[code])


def read_gguf_header(path: Path, buf) -> tuple[dict, dict[str, GGUFTensor]]:
    """Parse metadata and tensor directory from ``buf`` (the whole file, e.g. an mmap).

    Checks that every tensor's data lies inside the file.
    """
    cur = _Cursor(buf, path)
    if len(buf) < 4 or bytes(buf[:4]) != b"GGUF":
        raise WeightsError(f"{path}: not a GGUF file: expected magic b'GGUF', found {bytes(buf[:4])!r}")
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        raise WeightsError(f"{path}: unsupported GGUF version {version} (expected 2 or 3, little-endian)")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")

    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        infos.append((name, tuple(reversed(dims)), cur.take("I"), cur.take("Q")))

    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, shape, code, rel_offset in infos:
        if code not in _TENSOR_TYPES:
            type_name = _OTHER_TYPE_NAMES.get(code, f"type {code}")
            raise WeightsError(
                f"{path}: tensor {name} has unsupported type {type_name} "
                f"(supported: {', '.join(t[0] for t in _TENSOR_TYPES.values())})"
            )
        type_name, block, block_bytes = _TENSOR_TYPES[code]
        if not shape or shape[-1] % block:
            raise WeightsError(f"{path}: tensor {name} row length {shape[-1]} is not a multiple of {block}")
        nbytes = int(np.prod(shape)) // block * block_bytes
        offset = data_start + rel_offset
        if offset + nbytes > len(buf):
            raise WeightsError(
                f"{path}: truncated GGUF: tensor {name} needs bytes up to {offset + nbytes}, file has {len(buf)}"
            )
        tensors[name] = GGUFTensor(name, shape, type_name, offset, nbytes)
    return metadata, tensors


# ---------------------------------------------------------------------------
# Blocks -> MLX affine (packed uint32 weight, float16 scales and biases)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) uint8 codes -> (rows, cols*bits/32) uint32, MLX order (low bits first)."""
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)  # byte b holds weights 2b (low) and 2b+1 (high)
    return np.ascontiguousarray(q).view("<u4")


def _blocks_to_affine(raw: np.ndarray, type_name: str, rows: int, cols: int):
    """Raw GGUF blocks for a (rows, cols) matrix -> (weight, scales, biases, bits)."""
    blocks = raw.reshape(rows, cols // GROUP_SIZE, -1)  # (rows, n_groups, block_bytes)
    d = blocks[..., 0:2].copy().view("<f2")[..., 0]  # (rows, n_groups)
    if type_name in ("Q4_0", "Q4_1"):
        if type_name == "Q4_1":
            bias, qs = blocks[..., 2:4].copy().view("<f2")[..., 0], blocks[..., 4:]
        else:
            bias, qs = d * np.float16(-8), blocks[..., 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # byte j holds weight j (low), j+16 (high)
        return _pack(q.reshape(rows, cols), 4), d, bias, 4
    if type_name == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128  # signed -> unsigned code
        return _pack(q.astype(np.uint8).reshape(rows, cols), 8), d, d * np.float16(-128), 8
    raise AssertionError(type_name)


def _read_tensor(buf, t: GGUFTensor) -> dict[str, np.ndarray]:
    """One tensor as numpy arrays: {"weight": ...} or {"weight", "scales", "biases", "bits"}."""
    raw = np.frombuffer(buf[t.offset : t.offset + t.nbytes], np.uint8)  # a copy: no export pins the mmap
    if t.type_name == "F32":
        return {"weight": raw.view("<f4").reshape(t.shape)}
    if t.type_name == "F16":
        return {"weight": raw.view("<f2").reshape(t.shape)}
    if t.type_name == "BF16":
        return {"weight": raw.view("<u2").reshape(t.shape), "bf16": True}
    rows = int(np.prod(t.shape[:-1]))
    w, s, b, bits = _blocks_to_affine(raw, t.type_name, rows, t.shape[-1])
    return {"weight": w, "scales": s, "biases": b, "bits": bits}


# ---------------------------------------------------------------------------
# llama: names, the Q/K row permutation, config

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _hf_module(path: Path, gguf_name: str) -> tuple[str, str]:
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj', 'weight')."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return _TOP_NAMES[parts[0]], parts[1]
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}", parts[3]
    raise WeightsError(f"{path}: unexpected tensor {gguf_name} for architecture llama")


def _unpermute_rows(a: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (interleaved RoPE pairs) back to HF's rotate-half order.

    llama.cpp's converter did rows.reshape(n_heads, 2, head_dim//2, ...).swapaxes(1, 2);
    rows are output channels and quantization groups run along the input dim, so the
    same row shuffle applies to packed weights, scales and biases alike.
    """
    head_dim = a.shape[0] // n_heads
    rest = a.shape[1:]
    a = a.reshape(n_heads, head_dim // 2, 2, *rest)  # (n_heads, head_dim/2, 2, ...)
    return a.swapaxes(1, 2).reshape(n_heads * head_dim, *rest)  # (n_heads*head_dim, ...)


def _f32(x) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


def _llama_config(path: Path, md: dict, tensors: dict[str, GGUFTensor]) -> dict:
    def need(key):
        if key not in md:
            raise WeightsError(f"{path}: GGUF metadata lacks {key}")
        return int(md[key])

    experts = int(md.get("llama.expert_count", 0))
    if experts:
        raise WeightsError(f"{path}: llama.expert_count={experts}: mixture-of-experts GGUF not supported")
    hidden = need("llama.embedding_length")
    n_heads = need("llama.attention.head_count")
    head_dim = int(md.get("llama.attention.key_length", hidden // n_heads))
    rope_dims = int(md.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise WeightsError(f"{path}: llama.rope.dimension_count={rope_dims}, expected head_dim={head_dim}")
    vocab = int(md.get("llama.vocab_size", tensors["token_embd.weight"].shape[0]))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": need("llama.block_count"),
        "intermediate_size": need("llama.feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(md.get("llama.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(md.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": vocab,
        "max_position_embeddings": need("llama.context_length"),
        "rope_theta": _f32(md.get("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
    }
    scaling = md.get("llama.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": _f32(md["llama.rope.scaling.factor"])}
    elif scaling not in (None, "none"):
        raise WeightsError(f"{path}: llama.rope.scaling.type={scaling!r} not supported (expected none or linear)")
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):  # fmt: skip
        if f"tokenizer.ggml.{gguf_key}" in md:
            config[key] = int(md[f"tokenizer.ggml.{gguf_key}"])
    return config


# ---------------------------------------------------------------------------
# The import


def import_gguf(src: Path, dst: Path, *, progress: bool = False) -> dict:
    """Convert a llama GGUF file into a model directory at ``dst``.

    Args:
      src: the .gguf file.
      dst: the directory to create; must not exist (or be empty). Files are written to a
        temporary sibling and renamed into place, so a failure leaves nothing behind.
      progress: show a tqdm bar over tensors (on stderr).

    Returns:
      ``{"path", "n_params", "bits_per_weight", "bytes", "quantization"}``: parameter count
      (dequantized), stored weight bits per parameter, and total bytes written.

    Raises:
      WeightsError: not GGUF, truncated, unsupported architecture or tensor type.
      TokenizerError: vocabulary other than byte-level BPE.
    """
    src, dst = Path(src), Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise MlxInferError(f"{dst}: destination already exists and is not empty")
    try:
        f = open(src, "rb")
    except OSError as e:
        raise WeightsError(f"{src}: cannot open GGUF file: {e.strerror}") from None
    with f:
        if os.fstat(f.fileno()).st_size == 0:
            raise WeightsError(f"{src}: not a GGUF file: it is empty")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            md, tensors = read_gguf_header(src, buf)
            arch = md.get("general.architecture")
            if arch != "llama":
                raise WeightsError(f"{src}: general.architecture is {arch!r}; only 'llama' is supported")
            if "token_embd.weight" not in tensors:
                raise WeightsError(f"{src}: no token_embd.weight tensor")
            config = _llama_config(src, md, tensors)
            tok_json, tok_config = build_tokenizer(src, md)
            names = {n: _hf_module(src, n) for n in tensors}

            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.parent / f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp"  # same filesystem: rename is atomic
            tmp.mkdir()  # (not mkdtemp: its 0700 mode would stick to dst)
            try:
                report = _write(tmp, buf, tensors, names, config, progress)
                _write_tokenizer(tmp, tok_json, tok_config, config)
                if dst.exists():
                    dst.rmdir()  # empty, checked above
                os.replace(tmp, dst)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            buf.close()
    report["bytes"] = sum(p.stat().st_size for p in dst.iterdir())
    report["path"] = str(dst)
    return report


def _write(tmp: Path, buf, tensors: dict, names: dict, config: dict, progress: bool) -> dict:
    """model.safetensors and config.json; returns the report."""
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    weights, module_bits, n_params, n_bits = {}, {}, 0, 0
    for name, t in tqdm(tensors.items(), desc="import", unit="tensor", disable=not progress):
        module, kind = names[name]
        parts = _read_tensor(buf, t)
        permute = {"self_attn.q_proj": n_heads, "self_attn.k_proj": n_kv}.get(module.split(".", 3)[-1])
        if permute and t.shape[0] % (2 * permute):
            raise WeightsError(f"{name}: {t.shape[0]} rows do not split into {permute} heads of even size")
        for key in ("weight", "scales", "biases"):
            if key not in parts:
                continue
            a = parts[key]
            if permute:
                a = _unpermute_rows(a, permute)
            arr = mx.array(np.ascontiguousarray(a))
            if parts.get("bf16"):
                arr = arr.view(mx.bfloat16)
            out = f"{module}.{kind}" if key == "weight" else f"{module}.{key}"
            weights[out] = arr
            n_bits += arr.nbytes * 8
        n_params += int(np.prod(t.shape))
        if kind == "weight" and len(t.shape) == 2:  # a Linear or Embedding
            module_bits[module] = parts.get("bits")

    quantization = None
    counts = Counter(b for b in module_bits.values() if b)
    if counts:
        bits = counts.most_common(1)[0][0]
        quantization = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
        for module, b in sorted(module_bits.items()):
            if b != bits:
                quantization[module] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"} if b else False
        config["quantization"] = quantization
        config["torch_dtype"] = "float16"  # the scales' dtype
    else:
        config["torch_dtype"] = {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(
            weights["model.embed_tokens.weight"].dtype, "float32"
        )

    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(tmp / "config.json", config)
    return {"n_params": n_params, "bits_per_weight": round(n_bits / n_params, 3), "quantization": quantization}


def _write_tokenizer(tmp: Path, tok_json: str, tok_config: dict, config: dict) -> None:
    (tmp / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    _write_json(tmp / "tokenizer_config.json", tok_config)
    specials = ("bos_token", "eos_token", "unk_token", "pad_token")
    _write_json(tmp / "special_tokens_map.json", {k: tok_config[k] for k in specials if tok_config.get(k)})
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    _write_json(tmp / "generation_config.json", {k: config[k] for k in ids if k in config})


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
