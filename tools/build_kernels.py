"""Build mlxinfer's compiled CPU kernels (csrc/) against the installed mlx wheel.

    python tools/build_kernels.py [--build-dir build/kernels] [--jobs N]

Needs a C++20 compiler, CMake >= 3.24 and nanobind >= 3 (`python -m pip install
"nanobind>=3"`; 2.x builds but every call fails against the mlx 0.32 wheels). The
module, _mlxinfer_kernels, lands in the build folder and records the MLX version it
was built for; importing it under another MLX raises ImportError.
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", default=str(ROOT / "build" / "kernels"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--debug", action="store_true", help="CMAKE_BUILD_TYPE=Debug")
    args = ap.parse_args()

    for tool in ("cmake",):
        if shutil.which(tool) is None:
            print(f"build_kernels: {tool} not found on PATH", file=sys.stderr)
            return 1
    try:
        import nanobind
    except ImportError:
        print('build_kernels: nanobind not installed (pip install "nanobind>=3")', file=sys.stderr)
        return 1
    if int(nanobind.__version__.split(".")[0]) < 3:
        print(f"build_kernels: nanobind {nanobind.__version__} found, >= 3 needed", file=sys.stderr)
        return 1
    import mlx.core as mx

    build = Path(args.build_dir)
    configure = [
        "cmake",
        "-S",
        str(ROOT / "csrc"),
        "-B",
        str(build),
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-DCMAKE_BUILD_TYPE={'Debug' if args.debug else 'Release'}",
    ]
    if shutil.which("ninja") and not (build / "CMakeCache.txt").exists():
        configure += ["-G", "Ninja"]
    print(f"build_kernels: mlx {mx.__version__}, nanobind {nanobind.__version__}", flush=True)
    subprocess.run(configure, check=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(args.jobs)], check=True)
    built = sorted(build.glob("_mlxinfer_kernels*"))
    if not built:
        print(f"build_kernels: no module in {build}", file=sys.stderr)
        return 1
    print(f"build_kernels: {built[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
