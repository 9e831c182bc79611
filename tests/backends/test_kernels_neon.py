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
