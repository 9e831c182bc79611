"""Fuzz targets: hostile checkpoint files end in success or our own error, within a time bound.

* safetensors: header mutations (dtypes, shapes, offsets, types, lengths, truncation) of a
  small valid file, then ``read_header`` and, where it accepts, MLX's load and a reduction
  over every tensor. MLX trusts the header (a bad one segfaults) and a failed allocation
  segfaults it too, so this target runs its whole hypothesis loop in one subprocess with an
  address-space limit (``AS_LIMIT``): an unbounded allocation fails the test. Where the
  safetensors library is installed it is the oracle: what we accept it must accept, and what
  it accepts we refuse only for MLX's own limits (its dtypes, int32 dimensions).
* config.json: values of every type, sign and size put in the keys of several families'
  configs, then ``build_model`` and, for a model small enough, a forward pass (in-process: the
  checks keep every size bounded and nothing is evaluated before the forward).
* tokenizer.json: nodes replaced, deleted or swapped for components known to panic, then
  load, encode and decode.
* the streaming detokenizer: random id sequences (byte tokens, ids outside the vocabulary)
  through byte-level BPE and SentencePiece with byte fallback; the segments must add up to
  ``decode(ids)``.

``MLXINFER_FUZZ_EXAMPLES`` sets the examples per target (``tools/fuzz.py`` runs thousands);
``MLXINFER_FUZZ_RANDOM=1`` draws new ones instead of the suite's fixed set.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from tiny_checkpoint import CONFIG, tokenizer_json

from mlxinfer.errors import MlxInferError
from mlxinfer.models import build_model
from mlxinfer.tokenization import Tokenizer

EXAMPLES = int(os.environ.get("MLXINFER_FUZZ_EXAMPLES", "100"))
RANDOM = os.environ.get("MLXINFER_FUZZ_RANDOM") == "1"
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BOUND_S = 10.0  # each example: a tiny file or model, milliseconds when all is well
AS_LIMIT = 3 << 30  # bytes of address space for the safetensors subprocess
ROOT = Path(__file__).resolve().parents[2]

INTS = st.sampled_from(
    [0, 1, 2, 3, 4, 7, 8, 16, 31, 64, -1, -2, 2**15, 2**16, 2**24, 2**31 - 1, 2**31, 2**32]
    + [2**32 + 4, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
) | st.integers(-(2**70), 2**70)
FLOATS = st.sampled_from([0.0, -0.0, 0.5, 1.0, -1.0, 1e-30, 1e308, float("nan"), float("inf")])
SCALARS = INTS | FLOATS | st.booleans() | st.none() | st.text(max_size=8)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _bounded(start: float, what: str) -> None:
    elapsed = time.monotonic() - start
    assert elapsed < BOUND_S, f"{what} took {elapsed:.1f} s (bound {BOUND_S} s)"


# --- safetensors: the whole loop in one subprocess under an address-space limit -----------------

SAFETENSORS_LOOP = r"""
import json, os, resource, struct, sys, time
from pathlib import Path

resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
import mlx.core as mx
from hypothesis import HealthCheck, given, settings, strategies as st

from mlxinfer.errors import MlxInferError, WeightsError
from mlxinfer.files.safetensors_check import read_header

try:
    import safetensors
except ImportError:
    safetensors = None

DTYPES = ["F32", "F16", "BF16", "I8", "U8", "BOOL", "I64", "F64", "F8_E5M2", "F4", "Q4", ""]
SEED = {
    "__metadata__": {"format": "mlx"},
    "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
    "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
    "c": {"dtype": "I8", "shape": [0, 5], "data_offsets": [32, 32]},
    "d": {"dtype": "U8", "shape": [3], "data_offsets": [32, 35]},
}
INTS = st.sampled_from(
    [0, 1, 2, 3, 4, 5, 8, 24, 32, 35, 36, -1, 2**16, 2**31 - 1, 2**31, 2**32, 2**32 + 2]
    + [2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
)
WRONG = st.sampled_from([None, True, 1.5, "3", [], {}, [[1]], float("nan")])
FIELD = st.sampled_from(["dtype", "shape", "data_offsets"])
OPS = st.one_of(
    st.tuples(st.just("dtype"), st.sampled_from("abcd"), st.sampled_from(DTYPES)),
    st.tuples(st.just("dim"), st.sampled_from("abcd"), st.integers(0, 3), INTS),
    st.tuples(st.just("rank"), st.sampled_from("abcd"), st.lists(INTS, max_size=6)),
    st.tuples(st.just("offset"), st.sampled_from("abcd"), st.integers(0, 1), INTS),
    st.tuples(st.just("wrong"), st.sampled_from("abcd"), FIELD, WRONG),
    st.tuples(st.just("drop"), st.sampled_from("abcd"), FIELD, st.none()),
    st.tuples(st.just("metadata"), WRONG, st.none(), st.none()),
    st.tuples(st.just("length"), INTS, st.none(), st.none()),
    st.tuples(st.just("data"), st.integers(-40, 40), st.none(), st.none()),
    st.tuples(st.just("raw"), st.binary(max_size=40), st.none(), st.none()),
)


def build(ops):
    header = json.loads(json.dumps(SEED))
    length, extra, raw = None, 0, None
    for op in ops:
        kind, a, b, c = (tuple(op) + (None, None, None))[:4]
        t = header.get(a) if isinstance(a, str) else None
        if kind == "dtype" and t:
            t["dtype"] = b
        elif kind == "dim" and t and isinstance(t.get("shape"), list):
            t["shape"] = (t["shape"] + [1] * 4)[: max(len(t["shape"]), b + 1)]
            t["shape"][b] = c
        elif kind == "rank" and t:
            t["shape"] = b
        elif kind == "offset" and t and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2:
            t["data_offsets"][b] = c
        elif kind == "wrong" and t:
            t[b] = c
        elif kind == "drop" and t:
            t.pop(b, None)
        elif kind == "metadata":
            header["__metadata__"] = a
        elif kind == "length":
            length = a
        elif kind == "data":
            extra = a
        elif kind == "raw":
            raw = a
    text = json.dumps(header).encode() if raw is None else raw
    data = bytes(range(35)) + b"\0" * max(extra, 0)
    if extra < 0:
        data = data[:extra]
    n = len(text) if length is None else length
    return struct.pack("<Q", n % 2**64) + text + data


def library_accepts(path):
    if safetensors is None:
        return None
    try:
        with safetensors.safe_open(str(path), framework="numpy"):
            return True
    except Exception:
        return False


counts = {"accepted": 0, "refused": 0}
trace = Path(os.environ["FUZZ_TRACE"])
work = trace.parent  # the test's own temporary folder: removed by pytest, not left in /tmp


@settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(OPS, min_size=1, max_size=4))
def target(ops):
    file = work / "model.safetensors"
    file.write_bytes(build(ops))
    trace.write_text(repr(ops))  # the example being run, if the process dies
    start = time.monotonic()
    try:
        tensors = read_header(file)
    except WeightsError as e:
        counts["refused"] += 1
        # Stricter than the library only where MLX is: its dtypes and int32 dimensions, and
        # a name given twice (JSON readers disagree on which one wins).
        mlx_only = ("not one MLX loads", "ints in 0..2147483647", "appears twice")
        if library_accepts(file) and not any(why in str(e) for why in mlx_only):
            raise AssertionError(f"refused a file the safetensors library accepts: {e}")
        return
    if library_accepts(file) is False:
        raise AssertionError(f"accepted a file the safetensors library refuses: {ops!r}")
    for name, array in mx.load(str(file)).items():
        assert list(array.shape) == tensors[name]["shape"], name
        mx.eval(array.sum())  # every byte read; no output larger than the tensor
    counts["accepted"] += 1
    assert time.monotonic() - start < BOUND_S, ops


target()
print("safetensors fuzz:", counts)
"""


def test_fuzz_safetensors_headers_in_a_subprocess(tmp_path):
    settings_lines = f"AS_LIMIT, EXAMPLES, DERANDOMIZE, BOUND_S = {AS_LIMIT}, {EXAMPLES}, {not RANDOM}, {BOUND_S}"
    code = settings_lines + SAFETENSORS_LOOP
    trace = tmp_path / "last-example.txt"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60 + EXAMPLES * BOUND_S,
        cwd=ROOT,
        env={**os.environ, "FUZZ_TRACE": str(trace)},
    )
    last = trace.read_text() if trace.exists() else "(none)"
    assert proc.returncode == 0, (
        f"exit {proc.returncode} on {last}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )
    assert "safetensors fuzz: {'accepted': " in proc.stdout


# --- config.json -> model build (and a forward when small) ----------------------------------------

SEEDS = {
    "llama": dict(CONFIG),
    "mistral": {**CONFIG, "model_type": "mistral", "sliding_window": 8},
    "qwen3": {**CONFIG, "model_type": "qwen3", "head_dim": 16},
    "gemma2": {**CONFIG, "model_type": "gemma2", "head_dim": 8, "sliding_window": 8},
    "mixtral": {
        **CONFIG,
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        **CONFIG,
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
    },
    "phi3": {
        **CONFIG,
        "model_type": "phi3",
        "original_max_position_embeddings": 64,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
        },
    },
    "llama3_rope": {
        **CONFIG,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
        },
    },
    "yarn": {**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 32,
        "n_layer": 1,
        "n_head": 4,
        "vocab_size": 300,
        "n_positions": 64,
    },
    "bloom": {
        "model_type": "bloom",
        "hidden_size": 32,
        "n_layer": 1,
        "n_head": 4,
        "vocab_size": 300,
    },
    "xglm": {
        "model_type": "xglm",
        "d_model": 32,
        "num_layers": 1,
        "attention_heads": 4,
        "ffn_dim": 64,
        "vocab_size": 300,
        "max_position_embeddings": 64,
    },
    "lfm2": {
        **CONFIG,
        "model_type": "lfm2",
        "num_hidden_layers": 2,
        "layer_types": ["conv", "full_attention"],
        "block_multiple_of": 16,
    },
    "deepseek_v3": {
        **CONFIG,
        "model_type": "deepseek_v3",
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_shared_experts": 1,
    },
}
KEYS = sorted(
    {k for seed in SEEDS.values() for k in seed} | {"rope_theta", "head_dim", "quantization"}
)
SMALL = 2**21  # parameters: a model this small also runs one forward


def _forward(model) -> None:
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    if n > SMALL or model.args.max_position_embeddings < 4:  # generation fits the context
        return
    cache = model.make_cache()
    mx.eval(model(mx.array([[0, 1, 2]]), cache))
    mx.eval(model(mx.array([[3]]), cache))


@FUZZ
@given(
    st.sampled_from(sorted(SEEDS)),
    st.lists(st.tuples(st.sampled_from(KEYS), VALUES | INTS), min_size=1, max_size=3),
)
def test_fuzz_config_to_model(seed, changes):
    config = copy.deepcopy(SEEDS[seed])
    for key, value in changes:
        config[key] = value
    start = time.monotonic()
    try:
        _forward(build_model(config))
    except MlxInferError:
        pass
    _bounded(start, f"{seed} with {changes!r}")


# --- tokenizer.json -> load, encode, decode --------------------------------------------------------

PANICKY = [
    {"type": "Replace", "pattern": {"String": ""}, "content": "aaaa"},
    {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<x>", "type_id": 0}}],
        "pair": [],
        "special_tokens": {},
    },
    {"type": "Split", "pattern": {"Regex": "(("}, "behavior": "Isolated", "invert": False},
    {"type": "ByteFallback"},
    {"type": "Sequence", "normalizers": []},
]


@pytest.fixture(scope="module")
def tokenizer_seed():
    return tokenizer_json(bos_id=0)


def _paths(node, prefix=()):
    """Every (path, node) of a JSON tree, lists sampled (a vocabulary has hundreds of entries)."""
    yield prefix, node
    if isinstance(node, dict):
        for key in list(node)[:40]:
            yield from _paths(node[key], prefix + (key,))
    elif isinstance(node, list):
        for i in range(min(len(node), 6)):
            yield from _paths(node[i], prefix + (i,))


def _mutate(data, choice: int, action: str, value):
    paths = [p for p, _ in _paths(data) if p]
    path = paths[choice % len(paths)]
    parent = data
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if action == "delete" and isinstance(parent, dict):
        del parent[last]
    elif action == "panicky":
        parent[last] = copy.deepcopy(PANICKY[choice % len(PANICKY)])
    else:
        parent[last] = value


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.integers(0, 10**6), st.sampled_from(["set", "delete", "panicky"]), VALUES | INTS
        ),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from(["hello world", "", "naïve 東京 🙂 <s></s>", "a" * 300]),
)
def test_fuzz_tokenizer_json(tmp_path_factory, tokenizer_seed, mutations, text):
    data = copy.deepcopy(tokenizer_seed)
    for choice, action, value in mutations:
        _mutate(data, choice, action, value)
    directory = tmp_path_factory.mktemp("tok", numbered=True)
    (directory / "tokenizer.json").write_text(json.dumps(data))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    start = time.monotonic()
    try:
        tokenizer = Tokenizer.from_dir(directory)
        ids = tokenizer.encode(text)
        assert isinstance(tokenizer.decode(ids + [10**6, -1]), str)
    except MlxInferError:
        pass
    _bounded(start, f"{mutations!r}")


# --- the streaming detokenizer ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def detokenizer_tokenizers(tmp_path_factory):
    from tokenizer_fixtures import build_sentencepiece

    bpe = tmp_path_factory.mktemp("bpe")
    (bpe / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (bpe / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    sp = build_sentencepiece(tmp_path_factory.mktemp("sp"))
    return [Tokenizer.from_dir(bpe), Tokenizer.from_dir(sp)]


@FUZZ
@given(
    st.integers(0, 1),
    st.lists(
        st.integers(-3, 3)  # ids near 0: control and special tokens
        | st.integers(3, 300)  # the byte tokens (byte fallback: 3..258) and merges
        | st.integers(0, 600)
        | st.sampled_from([10**6, 2**31, 2**32, 2**40, -(2**40)]),
        max_size=40,
    ),
    st.booleans(),
)
def test_fuzz_detokenizer(detokenizer_tokenizers, which, ids, skip_special):
    tokenizer = detokenizer_tokenizers[which]
    start = time.monotonic()
    detok = tokenizer.detokenizer(skip_special_tokens=skip_special)
    try:
        text = "".join(detok.add_token(i) for i in ids) + detok.finalize()
    except MlxInferError:
        return
    assert text == tokenizer.decode(ids, skip_special_tokens=skip_special)
    _bounded(start, f"{ids!r}")
