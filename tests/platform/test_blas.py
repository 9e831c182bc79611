"""The library binds MLX to the same fast BLAS as the CLI, with no extra call (Linux).

Which library MLX's ``cblas_sgemm`` binds to is read from the dynamic linker
itself (``LD_DEBUG=bindings``), in fresh processes: the CLI, ``import mlxinfer``
before MLX, and MLX imported first (then the binding is the wheel's reference
BLAS, and ``load`` says how to fix it). Skipped where there is no fast BLAS to
bind to (install ``libopenblas0-pthread``) or on another OS.
"""

import os
import subprocess
import sys

import pytest
from hf_models import add_tokenizer, make_tiny

from mlxinfer.platform.blas import find_fast_blas

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the BLAS preload is Linux-only"
    ),
    pytest.mark.skipif(
        find_fast_blas() is None,
        reason="no fast BLAS installed (apt-get install "
        "libopenblas0-pthread): nothing to bind MLX to",
    ),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path, _ = make_tiny(
        tmp_path_factory.mktemp("blas") / "tiny", vocab_size=320, max_position_embeddings=64
    )
    return add_tokenizer(path)


def _sgemm_binding(
    args: list[str], tmp_path, env: dict | None = None
) -> tuple[str, subprocess.CompletedProcess]:
    """Run ``args`` under LD_DEBUG=bindings; the library libmlx's cblas_sgemm was bound to."""
    out_prefix = tmp_path / f"ld-{len(list(tmp_path.iterdir()))}"
    env = {
        k: v
        for k, v in {**os.environ, **(env or {})}.items()
        if k not in ("LD_PRELOAD", "MLXINFER_BLAS")
    }
    run = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={**env, "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(out_prefix)},
    )
    lines = [
        line
        for f in tmp_path.glob(f"{out_prefix.name}.*")
        for line in f.read_text().splitlines()
        if "libmlx.so" in line and "`cblas_sgemm'" in line
    ]
    assert len(lines) == 1, (run.stderr, lines)
    return lines[0].split(" to ", 1)[1].split(" [")[0], run


LOAD = (
    "import mlxinfer; m, t = mlxinfer.load(%r, log=print); import mlx.core as mx; print('loaded')"
)


def test_library_binds_mlx_to_the_same_blas_as_the_cli(tiny_dir, tmp_path):
    cli, run = _sgemm_binding(
        [
            sys.executable,
            "-m",
            "mlxinfer",
            "generate",
            "-m",
            str(tiny_dir),
            "-p",
            "hi",
            "-n",
            "2",
            "--no-chat-template",
        ],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr
    library, run = _sgemm_binding([sys.executable, "-c", LOAD % str(tiny_dir)], tmp_path)
    assert run.returncode == 0, run.stderr
    assert library == cli == find_fast_blas()
    assert "warning" not in run.stdout


def test_mlx_imported_first_is_told_the_fix_once(tiny_dir, tmp_path):
    code = (
        "import mlx.core\n"
        + LOAD % str(tiny_dir)
        + "\nm, t = mlxinfer.load(%r, log=print)" % str(tiny_dir)
    )
    library, run = _sgemm_binding([sys.executable, "-c", code], tmp_path)
    assert run.returncode == 0, run.stderr
    assert "mlx_cpu.libs/libblas" in library  # the wheel's reference BLAS
    warnings = [line for line in run.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, run.stdout
    assert (
        "import mlxinfer before mlx" in warnings[0]
        and f"LD_PRELOAD={find_fast_blas()}" in warnings[0]
    )
