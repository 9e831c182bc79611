"""Shared fixtures. OpenBLAS is preloaded before anything imports mlx (speed only)."""

import os
import sys
import tempfile
from pathlib import Path

# The tests' helpers (tests/support/) are importable by name, here and in every subprocess a test
# starts (a rank, a CLI run, a script that imports them). So are the test modules of the other
# folders: a few tests share another's tiny checkpoints and prompts (``from test_qwen3_next
# import TINY``).
HERE = Path(__file__).resolve().parent
PATHS = [str(HERE / "support")] + sorted(
    str(d) for d in HERE.iterdir() if d.is_dir() and any(d.glob("test_*.py"))
)
sys.path[:0] = PATHS
os.environ["PYTHONPATH"] = os.pathsep.join(PATHS + [p for p in [os.environ.get("PYTHONPATH")] if p])

# The user cache (the default model, the CPU plans measured at load, the BLAS check's verdict)
# of this test run only: tests never write the developer's own; subprocesses (the CLI) inherit
# it. Set before mlxinfer is imported: the import checks the BLAS and caches the verdict there.
os.environ.setdefault("MLXINFER_CACHE", tempfile.mkdtemp(prefix="mlxinfer-test-cache-"))
# The CPU backend's decode plans at their plainest, not timed at load: on a loaded machine the
# timing picks differently from run to run (one tiny model got 17 different plan sets in 40 runs
# here), and every option rounds differently. The plans' own tests set their options themselves.
os.environ.setdefault("MLXINFER_CPU_PLANS", "off")

from mlxinfer.platform.blas import preload_openblas  # noqa: E402

preload_openblas()

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_hf_dir():
    """The real SmolLM2-135M-Instruct as a transformers-5 checkpoint (f32), built from the GGUF."""
    from fixtures import smollm2_hf_dir as build

    return build()


@pytest.fixture(scope="session")
def smollm2_mlx_dir():
    """Our own import of the SmolLM2 GGUF (4-bit, group 32)."""
    from fixtures import smollm2_mlx_dir as build

    return build()


@pytest.fixture(scope="session")
def smollm2_f32_dir(smollm2_hf_dir, tmp_path_factory):
    """The HF reference checkpoint converted by `mlxinfer.convert` at float32."""
    from mlxinfer.loading.convert import convert

    out = tmp_path_factory.mktemp("smollm2") / "f32"
    convert(smollm2_hf_dir, out, dtype="float32")
    return out
