"""``generate --distributed pipeline --prompt-cache-file F`` (mlxinfer/cache/prompt_file.py):
each rank keeps its own layers' caches in a file of its own, ``F.rank<r>of<s>``.

The ranks are started as tests/distributed/test_distributed.py starts them (MLX_RANK, MLX_HOSTFILE, one
process each). The reference is one process with its own ``--prompt-cache-file`` on the same
prompts: the same text, and the same count of tokens read from the file (the longest common
prefix of the tokens the first run held and the second prompt).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

PROMPTS = ["Hello world, the quick brown fox", "Hello world, the quick brown fox jumps over"]
CACHED = re.compile(r"prompt tokens\s+(\d+) \((\d+) cached\)")


# Past the default suite's six two-rank launches (what they check runs in-process by default, or
# in the launches kept): MLXINFER_SLOW=1 runs them.
TWO_RANKS = pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="a two-rank launch past the default suite's six: set MLXINFER_SLOW=1 to run",
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The 3-layer llama of tests/distributed/test_distributed.py: layers 0-1 on rank 0, 2 on rank 1."""
    from test_distributed import _checkpoint

    return _checkpoint(tmp_path_factory.mktemp("llama"))[0]


def _command(model_dir: Path, prompt: str, cache: Path, distributed: bool) -> list[str]:
    command = [sys.executable, "-m", "mlxinfer", "generate", "-m", str(model_dir)]
    command += ["--distributed", "pipeline"] if distributed else []
    command += ["-p", prompt, "--no-chat-template", "-n", "8", "-v"]
    return command + ["--prompt-cache-file", str(cache)]


def _alone(model_dir: Path, prompt: str, cache: Path) -> tuple[str, int, int]:
    """One process's text, its prompt's tokens and those it read from ``cache``."""
    import subprocess

    from test_distributed import WAIT_S

    done = subprocess.run(
        _command(model_dir, prompt, cache, False), capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    found = CACHED.search(done.stderr)
    return done.stdout, int(found.group(1)), int(found.group(2))


def _ranks(tmp_path: Path, model_dir: Path, prompt: str, cache: Path) -> tuple[str, list, list]:
    """Two pipeline ranks' run: rank 0's text, each rank's tokens read from its file, each
    rank's stderr."""
    from test_distributed import Ranks

    tmp_path.mkdir()
    with Ranks(tmp_path, _command(model_dir, prompt, cache, True)) as ranks:
        codes = [ranks.wait(0), ranks.wait(1)]
        errs = [ranks.text(r) for r in range(2)]
        assert codes == [0, 0], "\n".join(errs)
        cached = [int(CACHED.search(err).group(2)) for err in errs]
        return ranks.text(0, 0), cached, errs


def _files(cache: Path) -> list[Path]:
    return [Path(f"{cache}.rank{r}of2") for r in range(2)]


def _tokens(path: Path) -> list[int]:
    """The tokens (prompt and generated) a cache file holds, from its metadata."""
    import mlx.core as mx

    _, meta = mx.load(str(path), format="safetensors", return_metadata=True)
    return [int(t) for t in meta["user.tokens"].split(",")]


@TWO_RANKS
def test_pipeline_ranks_resume_each_from_its_own_file(llama, tmp_path):
    one, cache = tmp_path / "one.cache", tmp_path / "ranks.cache"
    held = 0  # the first prompt's tokens: the second prompt extends them
    for i, prompt in enumerate(PROMPTS):
        text, n, cached = _alone(llama, prompt, one)
        assert cached == held and n > held
        held = n
        got, got_cached, errs = _ranks(tmp_path / f"run{i}", llama, prompt, cache)
        assert got == text
        assert got_cached == [cached, cached]  # both ranks read their own file, or neither
        assert not any("warning" in err for err in errs), errs
        assert not cache.exists()
        for f in _files(cache):  # one process's tokens, greedy, in each rank's file
            assert _tokens(f) == _tokens(one)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="more two-rank launches than the suite's share: set MLXINFER_SLOW=1 to run",
)
def test_the_ranks_start_cold_together_when_one_file_is_missing_or_stale(llama, tmp_path):
    """Rank 1's file deleted, then an older one of rank 1's put back: rank 0's file is fine,
    but every rank starts cold (rank 0 says why in one line), one process's text."""
    cache = tmp_path / "ranks.cache"
    texts = [_alone(llama, prompt, tmp_path / "none.cache")[0] for prompt in PROMPTS]
    (tmp_path / "none.cache").unlink()
    _ranks(tmp_path / "first", llama, PROMPTS[0], cache)
    old = _files(cache)[1].read_bytes()
    _files(cache)[1].unlink()
    got, cached, errs = _ranks(tmp_path / "missing", llama, PROMPTS[1], cache)
    assert got == texts[1] and cached == [0, 0]
    warning = "not used (another rank's file is missing, refused or holds other tokens)"
    assert f"warning: {_files(cache)[0]}: {warning}; starting cold" in errs[0], errs[0]
    _files(cache)[1].write_bytes(old)  # the first run's tokens; rank 0's: the second run's
    got, cached, errs = _ranks(tmp_path / "stale", llama, PROMPTS[1], cache)
    assert got == texts[1] and cached == [0, 0]
    assert warning in errs[0] and warning in errs[1], errs


def test_a_file_of_another_split_is_refused_in_one_line(llama, tmp_path):
    """The rank's part of the model is in the fingerprint: a file written by one process, or
    under another split (tensor rank 0/2 against pipeline rank 0/2), is refused with the
    module's one-line warning and a fresh cache; the same part's file is read."""
    import mlxinfer
    from mlxinfer.cache.prompt_file import open_cache, rank_path, save

    model, tokenizer = mlxinfer.load(llama)
    path = tmp_path / "s.cache"
    pc, fingerprint, warning = open_cache(path, model)
    assert warning is None and pc.tokens == []
    list(mlxinfer.stream_generate(model, tokenizer, PROMPTS[0], max_tokens=3, prompt_cache=pc))
    assert len(pc.tokens) > 5
    save(path, pc, fingerprint, model)  # one process: no part
    refused = "written for another model, other --kv-bits / --max-kv-size or another split"
    for part in ("pipeline rank 0/2: layers 0-1 of 3", "tensor rank 0/2"):
        model.part = part
        got, part_fingerprint, warning = open_cache(path, model)
        assert got.tokens == [] and warning.startswith(f"{path}: not used ({refused}")
        assert warning.endswith("; starting cold") and "\n" not in warning
        if part.startswith("pipeline"):
            save(path, pc, part_fingerprint, model)
            assert open_cache(path, model)[0].tokens == pc.tokens  # its own part's file
    del model.part
    assert open_cache(path, model)[0].tokens == []  # now a pipeline rank's: refused
    # The file names: F in one process, F.rank<r>of<s> on each of s > 1 ranks.
    assert rank_path(path, SimpleNamespace(ranks=SimpleNamespace(rank=0, size=1))) == path
    two = SimpleNamespace(ranks=SimpleNamespace(rank=1, size=2))
    assert rank_path(path, two) == Path(f"{path}.rank1of2")
