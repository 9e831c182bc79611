"""Hostile checkpoints end in our one-line error, never a crash: safetensors headers and shard
indexes, config.json values, token ids, tokenizer files.

What would crash the interpreter on the code before these checks (a segmentation fault: MLX's
embedding and safetensors reader trust their input) runs in a subprocess that must exit 0,
having printed our error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_checkpoint import CONFIG, VOCAB, safetensors_bytes, tokenizer_json, write_checkpoint

from mlxinfer.errors import ConfigError, TokenIdError, TokenizerError, WeightsError
from mlxinfer.files.safetensors_check import MAX_HEADER_BYTES, read_header
from mlxinfer.loading.loader import load, load_model, read_weights
from mlxinfer.models import build_model

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, timeout: float = 120) -> tuple[int, str]:
    """Run ``code`` in a fresh interpreter; (exit code, stdout + stderr)."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "RUST_BACKTRACE": "0"},  # PYTHONPATH: tests/support (conftest.py)
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "ok")


def copy_of(checkpoint: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in checkpoint.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# --- safetensors ---------------------------------------------------------------------------------


def test_an_overflowing_shape_with_empty_offsets_is_refused_before_mlx_reads_it(tmp_path):
    """65536**4 float32 elements are 2**66 bytes, 0 modulo 2**64: MLX's reader takes the empty
    range [0, 0] for them and hands out an array over no memory, whose first reduction crashed
    the process."""
    (tmp_path / "model.safetensors").write_bytes(
        safetensors_bytes({"w": {"dtype": "F32", "shape": [65536] * 4, "data_offsets": [0, 0]}})
    )
    rc, out = run_python(f"""
        from pathlib import Path
        import mlx.core as mx
        from mlxinfer.errors import WeightsError
        from mlxinfer.loading.loader import read_weights
        try:
            w = read_weights(Path({str(tmp_path)!r}))["w"]
            mx.eval(w.sum(axis=0))
        except WeightsError as e:
            print("WeightsError:", e)
    """)
    assert rc == 0, out
    assert "WeightsError:" in out and f"is {2**66} bytes, but data_offsets [0, 0] hold 0" in out


F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
BAD_HEADERS = {
    # shape × dtype size must be the byte range (the library's TensorInvalidInfo)
    "bytes": ({"w": {**F32_2x2, "shape": [2, 3]}}, 16, "is 24 bytes, but data_offsets [0, 16]"),
    "dtype": ({"w": {**F32_2x2, "dtype": "F64"}}, 16, "dtype 'F64' is not one MLX loads"),
    "negative dim": ({"w": {**F32_2x2, "shape": [-2, -2]}}, 16, "shape should be a list of ints"),
    "bool dim": ({"w": {**F32_2x2, "shape": [True, 4]}}, 16, "shape should be a list of ints"),
    "offsets": ({"w": {**F32_2x2, "data_offsets": [16, 0]}}, 16, "0 <= begin <= end"),
    # ranges: each begins where the one before ended, the last ends the file
    "overlap": (
        {"a": F32_2x2, "b": {**F32_2x2, "data_offsets": [8, 24]}},
        24,
        "'b' data_offsets [8, 24] overlaps the tensor before it",
    ),
    "gap": (
        {"a": F32_2x2, "b": {**F32_2x2, "data_offsets": [24, 40]}},
        40,
        "'b' data_offsets [24, 40] leaves a gap before it",
    ),
    "trailing": ({"w": F32_2x2}, 20, "4 bytes after the last tensor"),
    "metadata": ({"__metadata__": {"a": 1}, "w": F32_2x2}, 16, "'__metadata__' should map"),
    "not an object": ([1, 2], 0, "header should be a JSON object"),
    "tensor entry": ({"w": [0, 16]}, 16, "expected an object with dtype, shape and data_offsets"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_safetensors_headers_against_the_library_rules(tmp_path, case):
    header, n_data, message = BAD_HEADERS[case]
    (tmp_path / "model.safetensors").write_bytes(safetensors_bytes(header, bytes(n_data)))
    with pytest.raises(WeightsError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_weights(tmp_path)


def test_safetensors_header_text_that_is_not_plain_json(tmp_path):
    file = tmp_path / "model.safetensors"
    for raw, message in [
        (b"[" * 100_000, "nested too deeply"),  # RecursionError in json
        (b'{"w": 1, "w": 2}', "key 'w' appears twice"),
        (b'{"w": "\xff"}', "not valid UTF-8 JSON"),
    ]:
        file.write_bytes(len(raw).to_bytes(8, "little") + raw)
        with pytest.raises(WeightsError, match=message):
            read_weights(tmp_path)
    # A header past the library's 100 MB cap is refused before it is read (a sparse file).
    with open(file, "wb") as f:
        f.write((MAX_HEADER_BYTES + 1).to_bytes(8, "little"))
        f.truncate(8 + MAX_HEADER_BYTES + 1)
    with pytest.raises(WeightsError, match="over the safetensors limit of 100000000"):
        read_header(file)


def test_a_shard_index_names_only_files_inside_the_model_directory(checkpoint, tmp_path):
    model_dir = copy_of(checkpoint, tmp_path / "m")
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((model_dir / "model.safetensors").read_bytes())
    (model_dir / "model.safetensors").unlink()
    index = model_dir / "model.safetensors.index.json"
    for name in ["../outside.safetensors", str(outside)]:
        index.write_text(json.dumps({"weight_map": {"lm_head.weight": name}}))
        with pytest.raises(WeightsError, match="leads outside the model directory"):
            load_model(model_dir)
    # A link that leads out is refused too, named or found by the glob ...
    (model_dir / "shard.safetensors").symlink_to(outside)
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "shard.safetensors"}}))
    with pytest.raises(WeightsError, match="is a link to .*outside the model directory"):
        load_model(model_dir)
    index.unlink()
    with pytest.raises(WeightsError, match="is a link to .*outside the model directory"):
        load_model(model_dir)
    # ... but a Hugging Face cache snapshot's links into its repository's blobs/ load.
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for f in checkpoint.iterdir():
        (repo / "blobs" / f.name).write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("../../blobs") / f.name)
    load_model(snapshot)


# --- config.json ---------------------------------------------------------------------------------

BAD_CONFIGS = {
    # value -> the old failure: ZeroDivisionError / TypeError / ValueError / AttributeError from
    # model construction, or a silently wrong model
    "num_attention_heads": (0, "'num_attention_heads' must be in 1..16384, found 0"),
    "hidden_size": ("32", "'hidden_size' must be an integer, found '32'"),
    "intermediate_size": (64.0, "'intermediate_size' must be an integer, found 64.0"),
    "num_hidden_layers": (True, "'num_hidden_layers' must be an integer, found True"),
    "vocab_size": (-5, "'vocab_size' must be in 1..16777216, found -5"),
    "max_position_embeddings": (2**40, "'max_position_embeddings' must be in 1..67108864"),
    "rms_norm_eps": (float("nan"), "'rms_norm_eps' must be a finite number, found nan"),
    "num_key_value_heads": (3, "'num_attention_heads' must be a multiple of 'num_key_value_heads'"),
    "rope_theta": ("high", "'rope_theta' must be a finite number > 0, found 'high'"),
    "rope_scaling": ({"rope_type": "linear", "factor": 0}, "rope_scaling 'factor' must be > 0"),
    "model_type": (["llama"], "'model_type' must be a string, found \\['llama'\\]"),
    "quantization": ("yes", "'quantization' must be an object, found 'yes'"),
    "tie_word_embeddings": (1, "'tie_word_embeddings' must be true or false, found 1"),
}


@pytest.mark.parametrize("key", sorted(BAD_CONFIGS))
def test_config_values_of_the_wrong_type_or_range_are_config_errors(checkpoint, tmp_path, key):
    value, message = BAD_CONFIGS[key]
    model_dir = copy_of(checkpoint, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ConfigError, match=message):
        load_model(model_dir)


def test_family_rules_and_the_last_line_of_defence():
    base = dict(CONFIG)
    mixtral = {**base, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3}
    with pytest.raises(ConfigError, match=r"'num_experts_per_tok' must be in 1\.\.2 .* found 3"):
        build_model(mixtral)
    with pytest.raises(ConfigError, match=r"'num_experts_per_tok' must be in 1\.\.2 .* found 0"):
        build_model({**mixtral, "num_experts_per_tok": 0})  # a reshape error at the forward before
    gpt2 = {"model_type": "gpt2", "n_embd": 30, "n_layer": 1, "n_head": 4, "vocab_size": 300}
    with pytest.raises(ConfigError, match="'hidden_size' must be a multiple of"):
        build_model(gpt2)  # a reshape error at the first forward before
    # Values that pass every check but that a family's constructor still trips over (YaRN
    # divides by log(rope_theta)): a ConfigError, not the ZeroDivisionError of before.
    yarn = {**base, "rope_theta": 1.0, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    with pytest.raises(ConfigError, match="config.json: cannot build a 'llama' model from it"):
        build_model(yarn)


def test_special_ids_against_the_embedding_rows(checkpoint, tmp_path):
    # EOS is only compared with: one outside the rows is dropped, with a warning.
    model_dir = copy_of(checkpoint, tmp_path / "eos")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 5000]}))
    with pytest.warns(RuntimeWarning, match=r"EOS id\(s\) \[5000\] outside the model's 300-row"):
        _, tokenizer = load(model_dir)
    assert 5000 not in tokenizer.eos_token_ids and 2 in tokenizer.eos_token_ids


def test_a_bos_past_the_embedding_is_refused_at_load(tmp_path):
    """The tokenizer adds BOS id 100000 to every prompt; the embedding has 300 rows. Before the
    check, loading succeeded and the first generation read far past the table (a crash)."""
    model_dir = write_checkpoint(tmp_path / "bos", tokenizer=tokenizer_json(bos_id=100_000))
    rc, out = run_python(f"""
        from mlxinfer import generate, load
        from mlxinfer.errors import ConfigError
        try:
            model, tokenizer = load({str(model_dir)!r})
            print(generate(model, tokenizer, "hello", max_tokens=2))
        except ConfigError as e:
            print("ConfigError:", e)
    """)
    assert rc == 0, out
    assert "ConfigError:" in out and "has id 100000, outside the model's 300-row embedding" in out


# --- token ids -----------------------------------------------------------------------------------


def test_token_ids_past_the_embedding_are_refused_before_a_forward(checkpoint):
    """A prompt given as ids, to stream_generate and to the batch engine: an id past the rows
    crashed the process (MLX's embedding reads wherever the id points)."""
    rc, out = run_python(f"""
        from mlxinfer import generate, load
        from mlxinfer.batch import Engine
        from mlxinfer.errors import TokenIdError
        model, tokenizer = load({str(checkpoint)!r})
        try:
            generate(model, tokenizer, [1, 2, 10**6], max_tokens=2)
        except TokenIdError as e:
            print("TokenIdError:", e)
        with Engine(model, block_size=16, max_batch=2) as engine:
            try:
                engine.submit([5, 10**6], max_tokens=2)
            except TokenIdError as e:
                print("TokenIdError:", e)
            print("still serving:", len([s.token for s in engine.submit([5, 6], max_tokens=2).steps()]))
    """)
    assert rc == 0, out
    assert out.count("token id 1000000 (position ") == 2 and f"expected 0..{VOCAB - 1}" in out
    assert "still serving: 2" in out


def test_token_ids_in_process(checkpoint):
    from mlxinfer import generate

    model, tokenizer = load(checkpoint)
    for prompt, message in [
        ([1, VOCAB], f"token id {VOCAB} \\(position 1\\)"),  # one past: garbage before, no crash
        ([1, -1], "token id -1"),  # wrapped around to the last row before
        ([1, True], "item 1 should be a token id"),
        ([1, 2.5], "item 1 should be a token id"),
    ]:
        with pytest.raises(TokenIdError, match=message):
            generate(model, tokenizer, prompt, max_tokens=1)


# --- tokenizer files -----------------------------------------------------------------------------


def test_tokenizer_library_panics_are_tokenizer_errors(checkpoint, tmp_path):
    """`tokenizers` panics (pyo3's PanicException derives from BaseException: it went past every
    ``except Exception``) on these tokenizer.json files when encoding."""
    model_dir = copy_of(checkpoint, tmp_path / "m")
    base = tokenizer_json()
    for change in [
        {"normalizer": {"type": "Replace", "pattern": {"String": ""}, "content": "aaaa"}},
        {
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<nope>", "type_id": 0}}],
                "pair": [],
                "special_tokens": {},
            }
        },
    ]:
        (model_dir / "tokenizer.json").write_text(json.dumps({**base, **change}))
        from mlxinfer.tokenization import Tokenizer

        tokenizer = Tokenizer.from_dir(model_dir)
        with pytest.raises(TokenizerError, match=r"tokenizer.json: encode failed \(PanicException"):
            tokenizer.encode("hello")


def test_token_ids_outside_the_libraries_range_decode_to_nothing(checkpoint):
    from mlxinfer.tokenization import Tokenizer

    tokenizer = Tokenizer.from_dir(checkpoint)
    assert tokenizer.decode([2**40, -3]) == ""  # an OverflowError from `tokenizers` before
    detok = tokenizer.detokenizer()
    assert detok.add_token(2**40) == "" and detok.finalize() == ""
    assert tokenizer.id_to_token(2**40) is None


def test_added_token_ids_are_bounded(tmp_path):
    """An added token's id sizes a table (SentencePiece) or the vocabulary (tiktoken): 10**15
    was a MemoryError, or a table of that many entries."""
    from tokenizer_fixtures import build_sentencepiece

    from mlxinfer.tokenization import Tokenizer

    sp = build_sentencepiece(tmp_path / "sp")
    config = json.loads((sp / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(10**15): {"content": "<big>", "special": True}}
    (sp / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="added token '<big>' has id 1000000000000000"):
        Tokenizer.from_dir(sp)
    tik = tmp_path / "tik"
    tik.mkdir()
    import base64

    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    lines.append(f"{base64.b64encode(b'ab').decode()} {10**15}")
    (tik / "tokenizer.tiktoken").write_text("\n".join(lines))
    with pytest.raises(TokenizerError, match="line 257 has rank 1000000000000000"):
        Tokenizer.from_dir(tik)


def test_the_detokenizer_drops_ids_outside_the_vocabulary_as_decode_does(tmp_path):
    """A model's embedding may have more rows than its tokenizer has ids (padded vocabularies),
    so such an id can be sampled. decode() skips it; the streaming detokenizer took it for a
    token that ends a run of byte-fallback tokens and wrote out an "é" that decode fuses with
    the byte after it into an invalid run (found by test_fuzz_files' detokenizer target)."""
    from tokenizer_fixtures import build_sentencepiece

    from mlxinfer.tokenization import Tokenizer

    tokenizer = Tokenizer.from_dir(build_sentencepiece(tmp_path / "sp"))
    c3, a9 = (tokenizer.token_to_id(f"<0x{b:02X}>") for b in "é".encode())
    for outside in (tokenizer.vocab_size, -1, 10**6):
        # decode skips the outside id and fuses C3 A9 A9, not UTF-8: one U+FFFD per byte
        ids = [c3, a9, outside, a9]
        detok = tokenizer.detokenizer()
        streamed = "".join(detok.add_token(i) for i in ids) + detok.finalize()
        assert streamed == tokenizer.decode(ids) == "\ufffd" * 3
