"""The kernels' NEON paths (csrc/src/neon.cpp), cross-compiled for arm64 and run under qemu.

csrc/tests/check_kernels.cpp checks every instruction-set path of the kernels on plain pointers
(no MLX) against its own double-precision reference: affine 2/3/4/5/6/8-bit (MLX's bit stream)
at group sizes 32/64/128 and MLX's float modes (mxfp4, nvfp4, mxfp8; every E4M3 code) with 1..16
rows of x and odd N, f32/bf16/f16 weights with K off the vector width, and every
finite bf16 and f16 value widened bit for bit (tools/check_kernels_cross.py builds and runs it).
Under qemu the arm64 build must pick NEON and agree within 1e-4 of the largest output on
every case. It skips, naming the tool, without aarch64-linux-gnu-g++ or qemu-aarch64 (Debian:
``apt-get install g++-aarch64-linux-gnu qemu-user``). The native build (the x86 paths against the
same reference; tests/backends/test_kernels.py checks them against MLX in the suite) runs under
MLXINFER_SLOW=1. Builds are cached by a hash of the sources in the test cache.
"""

import os
import re
import subprocess

import pytest
from fixtures import cache_root, load_script

cross = load_script("tools/check_kernels_cross.py")
# The test cache's root (cache_root() is its SmolLM2 folder), not the developer's build/.
BUILD = cache_root().parent / "check-kernels"


def run_check(target: str) -> list[str]:
    """The check's output lines for `target`, asserting it passed."""
    try:
        binary, _ = cross.build(target, BUILD, os.cpu_count() or 1)
    except cross.MissingTool as e:
        pytest.skip(str(e))
    except subprocess.CalledProcessError as e:
        pytest.fail(f"build failed: {' '.join(e.cmd)}\n{e.stderr}", pytrace=False)
    result = cross.run(target, binary)
    lines = result.stdout.splitlines()
    failed = [ln for ln in lines if "FAIL" in ln]
    assert result.returncode == 0 and not failed, (result.returncode, failed[:5], result.stderr)
    summary = re.fullmatch(r"check_kernels: (\d+) cases, 0 failed, .*", lines[-1])
    assert summary, lines[-1]
    cases = [ln for ln in lines if ln.endswith(" ok")]
    assert len(cases) == int(summary.group(1)) >= 660  # six widths' cases and the float modes'
    for kind in ("bits=2", "bits=3", "bits=5", "bits=6", "mxfp4", "nvfp4", "mxfp8"):
        assert any(ln.startswith(f"qmv {kind} ") for ln in cases), kind
    assert any(ln.startswith("widen e4m3: ") for ln in cases)  # every mxfp8 code, bit for bit
    return lines


def test_neon_under_qemu():
    lines = run_check("aarch64")
    assert lines[0] == "check_kernels: best ISA neon; paths: scalar neon"
    # Each case ran both paths: the scalar one and NEON (not a silent fallback to scalar), but
    # nvfp4 rows whose K is off a multiple of 32, which NEON leaves to the scalar path
    # (kernels.h, qmv_isa).
    for line in lines[1:-1]:
        short = re.match(r"qmv nvfp4 gs=16 K=(\d+) ", line)
        if short and int(short.group(1)) % 32:
            assert re.search(r": scalar \S+ scalar \S+ ok$", line), line
        else:
            assert re.search(r": scalar \S+ neon \S+ ok$", line), line


@pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="a native build of the check (~10-20 s on 2 cores): set MLXINFER_SLOW=1 to run",
)
def test_native_paths():
    lines = run_check("native")
    paths = re.fullmatch(r"check_kernels: best ISA (\S+); paths: (.*)", lines[0])
    assert paths and paths.group(2).split()[-1] == paths.group(1), lines[0]


def test_every_source_with_an_architecture_switch_compiles_for_arm64():
    """A Mac builds the module for arm64, where every ``#if defined(MLXINFER_X86)`` part is left
    out: each source that has such a switch (or an ``__aarch64__`` one) compiles there, checked
    by the cross compiler with MLX's and nanobind's headers (syntax only, ~10 s on 2 cores).
    A name used outside its x86-only part broke exactly this once (csrc/src/i16.h)."""
    import shutil
    import sysconfig
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import mlx.core as mx

    nanobind = pytest.importorskip(
        "nanobind", reason="nanobind's headers (the test extras' nanobind)"
    )
    compiler = shutil.which("aarch64-linux-gnu-g++")
    if compiler is None:
        pytest.skip("aarch64-linux-gnu-g++ absent (Debian: apt-get install g++-aarch64-linux-gnu)")
    src = Path(__file__).resolve().parents[2] / "csrc" / "src"
    switched = [
        f
        for f in sorted(src.glob("*.cpp"))
        if re.search(r"MLXINFER_X86|__aarch64__", f.read_text())
    ]
    assert len(switched) >= 10  # the kernels' vector paths and the primitives around them
    includes = [
        src,
        Path(mx.__file__).parent / "include",
        nanobind.include_dir(),
        sysconfig.get_paths()["include"],
    ]
    command = [compiler, "-std=c++20", "-fsyntax-only", *(f"-I{i}" for i in includes)]

    def check(f: Path) -> tuple[str, str]:
        result = subprocess.run([*command, str(f)], capture_output=True, text=True, timeout=120)
        return f.name, result.stderr if result.returncode else ""

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        failed = {name: err for name, err in pool.map(check, switched) if err}
    assert not failed, {name: err[-600:] for name, err in failed.items()}
