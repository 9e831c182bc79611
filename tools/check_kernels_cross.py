"""Build and run csrc/tests/check_kernels.cpp: the kernels' every instruction-set path against a
double-precision reference, natively and for arm64 (cross-compiled, run under qemu).

    python3 tools/check_kernels_cross.py [--target native|aarch64|all] [--build-dir DIR] [-q]

native:  the host compiler (`c++`, or $CXX): on x86-64 the scalar, AVX2 and AVX-512 paths this CPU
         has. aarch64: `aarch64-linux-gnu-g++` and `qemu-aarch64` (or qemu-aarch64-static) with the
         cross C++ runtime in /usr/aarch64-linux-gnu (Debian: `apt-get install
         g++-aarch64-linux-gnu qemu-user`): the scalar and NEON paths. No MLX is needed: the
         check links only the kernels on plain pointers (isa, quantized, matvec, neon).

Each build lands in DIR/<target>-<key>, the key a hash of the sources, the compiler and its flags,
so an unchanged tree is not rebuilt. Exit status 0 when every target built and passed, 1 when a
check failed, 2 when a tool is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "csrc" / "src"
KERNELS = ["isa.cpp", "quantized.cpp", "matvec.cpp", "neon.cpp"]  # no MLX headers in these
HEADERS = ["kernels.h", "simd.h"]
CHECK = ROOT / "csrc" / "tests" / "check_kernels.cpp"
# As csrc/CMakeLists.txt builds the module (-O3), less the MLX parts; GCC 12's AVX-512 headers
# trip the uninitialized warnings on their own _mm512_undefined_* (as there).
FLAGS = ["-std=c++20", "-O3", "-Wall", "-Wno-maybe-uninitialized", "-Wno-uninitialized"]
HARNESS_FLAGS = FLAGS + ["-O1"]  # the check itself needs no -O3, and builds seconds sooner
SYSROOT = Path("/usr/aarch64-linux-gnu")
TARGETS = ("native", "aarch64")


class MissingTool(Exception):
    """A compiler, emulator or runtime this target needs is not installed (the message names it)."""


def cross_tools(target: str) -> tuple[str, list[str]]:
    """(the C++ compiler, the command prefix that runs its binaries) for `target`."""
    if target == "native":
        cxx = os.environ.get("CXX") or "c++"
        if shutil.which(cxx) is None:
            raise MissingTool(f"{cxx} not found on PATH (a C++20 compiler; set CXX)")
        return cxx, []
    cxx = "aarch64-linux-gnu-g++"
    if shutil.which(cxx) is None:
        raise MissingTool(f"{cxx} not found on PATH (apt-get install g++-aarch64-linux-gnu)")
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if qemu is None:
        raise MissingTool("qemu-aarch64 not found on PATH (apt-get install qemu-user)")
    if not (SYSROOT / "lib").is_dir():
        raise MissingTool(f"{SYSROOT}/lib not found (the arm64 C++ runtime; libc6-arm64-cross)")
    return cxx, [qemu, "-L", str(SYSROOT)]


def build_key(cxx: str) -> str:
    """A hash of what the binary is made of: sources, compiler version and flags."""
    h = hashlib.sha256()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    h.update(version.stdout.encode())
    h.update(" ".join(FLAGS + ["|"] + HARNESS_FLAGS).encode())
    for path in [CHECK] + [SRC / name for name in KERNELS + HEADERS]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build(target: str, build_dir: Path, jobs: int) -> tuple[Path, float | None]:
    """The check binary for `target` and its build time in seconds (None: it was built before).

    Raises MissingTool, or subprocess.CalledProcessError with the compiler's output."""
    cxx, _ = cross_tools(target)
    out = build_dir / f"{target}-{build_key(cxx)}"
    binary = out / "check_kernels"
    if binary.is_file():
        return binary, None
    start = time.perf_counter()
    build_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target}-", dir=build_dir) as work:
        sources = [CHECK] + [SRC / name for name in KERNELS]

        def compile_one(src: Path) -> Path:
            obj = Path(work) / (src.stem + ".o")
            flags = HARNESS_FLAGS if src == CHECK else FLAGS
            cmd = [cxx, *flags, f"-I{SRC}", "-c", str(src), "-o", str(obj)]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            return obj

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objects = list(pool.map(compile_one, sources))
        linked = Path(work) / "check_kernels"
        link = [cxx, *[str(o) for o in objects], "-o", str(linked)]
        subprocess.run(link, check=True, capture_output=True, text=True)
        out.mkdir(exist_ok=True)
        os.replace(linked, binary)  # whole or absent: a half-built binary is never reused
    return binary, time.perf_counter() - start


def run(target: str, binary: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs the check (under qemu for aarch64); its output in .stdout, exit status 1 on failure."""
    _, prefix = cross_tools(target)
    return subprocess.run(
        [*prefix, str(binary)], capture_output=True, text=True, timeout=timeout, check=False
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=(*TARGETS, "all"), default="all")
    ap.add_argument("--build-dir", default=str(ROOT / "build" / "check_kernels"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-q", "--quiet", action="store_true", help="only failures and the summary")
    args = ap.parse_args()

    failed = missing = False
    for target in TARGETS if args.target == "all" else (args.target,):
        name = f"check_kernels_cross[{target}]"
        try:
            binary, seconds = build(target, Path(args.build_dir), args.jobs)
        except MissingTool as e:
            print(f"{name}: skipped: {e}")
            missing = True
            continue
        except subprocess.CalledProcessError as e:
            print(f"{name}: build failed: {' '.join(e.cmd)}\n{e.stdout}{e.stderr}")
            failed = True
            continue
        built = "cached" if seconds is None else f"built in {seconds:.1f} s"
        start = time.perf_counter()
        result = run(target, binary)
        ran = time.perf_counter() - start
        lines = result.stdout.splitlines()
        shown = [ln for ln in lines if not ln.endswith(" ok")] if args.quiet else lines
        print("\n".join(shown))
        if result.stderr:
            print(result.stderr, end="")
        verdict = "passed" if result.returncode == 0 else f"FAILED (exit {result.returncode})"
        print(f"{name}: {binary} ({built}), ran in {ran:.1f} s: {verdict}")
        failed = failed or result.returncode != 0
    return 1 if failed else 2 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
