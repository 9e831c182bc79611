"""Shared fixtures. OpenBLAS is preloaded before anything imports mlx (speed only)."""

import atexit
import os
import shutil
import sys
import tempfile
import time
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
# Removed when the run ends (each run's was left in the temporary folder before).
if "MLXINFER_CACHE" not in os.environ:
    os.environ["MLXINFER_CACHE"] = tempfile.mkdtemp(prefix="mlxinfer-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MLXINFER_CACHE"], True)
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


# --- the per-test budget -------------------------------------------------------------------------
# The suite must fit 10 minutes on 2 cores, so each test's call (setup and teardown not counted:
# session fixtures build once) gets a budget, checked as CI runs (CI=true) or whenever
# MLXINFER_TEST_BUDGET is set (seconds; default 20). A loaded developer machine runs without it.
# Marked `real`: three budgets (a real model's prompt on 2 cores); marked `slow`: none (they are
# opt-in, MLXINFER_SLOW=1). A test over its budget fails by name; mark it slow or make it faster.
BUDGET_S = float(os.environ.get("MLXINFER_TEST_BUDGET") or 20)
REAL_BUDGETS = 3
# Tests allowed more, each with its reason: node id without parameters -> (budgets, reason).
# Measured on a quiet 2-core AMD EPYC VM (the whole suite 441 s): no unmarked call over 20 s but
# the short soak (17 s here, 18 s on a loaded VM), and no `real` one over 60 s (the slowest:
# output/test_constraints.py's twenty schemas, 21 s; real/test_gguf_gemma3.py's greedy output, 14 s).
OVER_BUDGET: dict[str, tuple[float, str]] = {
    "tests/hostile/test_soak.py::test_a_short_soak_serves_everything_refuses_the_hostile_and_drains": (
        2.0,
        "the one run of the server under mixed load in the default suite: it serves for a fixed time",
    ),
}


def _budget_s(item) -> float | None:
    if not (os.environ.get("CI") == "true" or os.environ.get("MLXINFER_TEST_BUDGET")):
        return None
    if item.get_closest_marker("slow"):
        return None
    budgets = 1.0
    if item.get_closest_marker("real"):
        budgets = REAL_BUDGETS
    allowed = OVER_BUDGET.get(item.nodeid.split("[")[0])
    if allowed:
        budgets = max(budgets, allowed[0])
    return budgets * BUDGET_S


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    start = time.perf_counter()
    result = yield  # a failing test fails as it is
    budget = _budget_s(item)
    took = time.perf_counter() - start
    if budget is not None and took > budget:
        pytest.fail(
            f"{item.nodeid} took {took:.1f} s, over its budget of {budget:.0f} s "
            f"(MLXINFER_TEST_BUDGET={BUDGET_S:g}): mark it `slow` (it then runs only under "
            "MLXINFER_SLOW=1) when another default test checks the same, or make it faster; "
            "else list it in OVER_BUDGET in tests/conftest.py with its reason",
            pytrace=False,
        )
    return result
