"""Builds mlxinfer's compiled CPU kernels (csrc/) while installing, where it can.

`pip install .` and `pip install -e .` run this through setuptools (the rest of the
package's metadata is in pyproject.toml). The kernels are configured with CMake and built
(`cmake -S csrc -B <tmp> -DPython_EXECUTABLE=<python>`, Ninja when present) into
`mlxinfer/backends/kernels/` (the source tree's folder for an editable install). They need a
C++20 compiler, CMake >= 3.24 and nanobind >= 3; pyproject's build requirements bring CMake,
Ninja, nanobind and mlx. Any failure prints one line, leaves that line beside the package
(`kernels.reason()` reports it), and the package installs without them: mlxinfer then runs on
MLX's own ops. `MLXINFER_BUILD_KERNELS=0` skips the build. An editable install run again keeps
the module it built when nothing it depends on changed (csrc/, mlx, nanobind, Python).

Which mlx: the module must be compiled against the mlx the runtime imports (it refuses another
at import). pip builds in an isolated environment with its own mlx; when the environment being
installed into already has an mlx satisfying the runtime requirement, that one is built
against instead (pip keeps it); otherwise the isolated one, which is the version pip's
resolver installs for the runtime too.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
NAME = "_mlxinfer_kernels"
PACKAGE = "mlxinfer.backends.kernels"
NOT_BUILT = NAME + ".not-built"  # the failure's one line, read by kernels.reason()
STAMP = NAME + ".stamp"  # what the module beside it was built from (editable reinstalls)
ENV = "MLXINFER_BUILD_KERNELS"  # "0": do not build them
MIN_CMAKE = (3, 24)
MIN_MLX = (0, 29)  # pyproject's runtime requirement


class NotBuilt(Exception):
    """Why the kernels were not built, in one line."""


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _run(cmd: list[str], what: str, env: dict | None = None) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        raise NotBuilt(f"{what} failed: {_first_error((p.stdout + p.stderr).splitlines())}")
    return p.stdout


def _first_error(lines: list[str]) -> str:
    """The first error of a CMake or compiler log, on one line (at most 300 characters)."""
    for i, line in enumerate(lines):
        if "CMake Error" in line:  # its message follows on indented lines
            detail = []
            for d in lines[i + 1 :]:
                if d.strip() and not d[0].isspace():
                    break
                detail += [d.strip()] if d.strip() else []
            return " ".join([line.strip(), *detail])[:300]
        if re.search(r"(^|\s|:)(fatal )?error:", line):  # file:line:col: error: ...
            return line.strip()[:300]
    rest = [line.strip() for line in lines if line.strip()]
    return rest[-1][:300] if rest else "no output"


def _target_mlx() -> tuple[str, str] | None:
    """The version and CMake folder of the mlx installed where this package is being
    installed, if any (and it satisfies the runtime requirement).

    pip runs the build with the target's interpreter, the isolated build environment put in
    front by PYTHONPATH (and PYTHONNOUSERSITE): without them that interpreter sees the target.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    code = (
        "import importlib.metadata as m, subprocess, sys; v = m.version('mlx');"
        "d = subprocess.run([sys.executable, '-m', 'mlx', '--cmake-dir'], capture_output=True,"
        " text=True, check=True).stdout.strip(); print(v); print(d)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    lines = p.stdout.splitlines()
    if p.returncode or len(lines) != 2 or _version(lines[0]) < MIN_MLX:
        return None
    return lines[0], lines[1]


def _configure_options() -> tuple[list[str], str]:
    """The configure options and a key of what the module depends on; NotBuilt when a tool
    is missing."""
    if os.environ.get(ENV, "") == "0":
        raise NotBuilt(f"{ENV}=0")
    cmake = shutil.which("cmake")
    if cmake is None:
        raise NotBuilt("cmake not found on PATH (CMake >= 3.24 needed)")
    found = _version(_run([cmake, "--version"], "cmake --version").splitlines()[0])
    if found < MIN_CMAKE:
        raise NotBuilt(f"CMake {'.'.join(map(str, found))} found, >= 3.24 needed")
    compilers = [os.environ.get("CXX", "")] + ["c++", "g++", "clang++"]
    if not any(c and shutil.which(c.split()[0]) for c in compilers):
        raise NotBuilt("no C++ compiler found ($CXX, c++, g++ or clang++; C++20 needed)")
    try:
        import nanobind
    except ImportError:
        raise NotBuilt("nanobind not installed (nanobind >= 3 needed)") from None
    if _version(nanobind.__version__) < (3,):
        raise NotBuilt(f"nanobind {nanobind.__version__} found, >= 3 needed")
    options = [f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        options += ["-G", "Ninja"]
    target = _target_mlx()
    if target:
        mlx_version = target[0]
        options.append(f"-DMLX_ROOT={target[1]}")
    else:
        try:
            mlx_version = importlib.metadata.version("mlx")
        except importlib.metadata.PackageNotFoundError:
            raise NotBuilt("mlx not installed in the build environment") from None
    key = hashlib.sha256()  # not MLX_ROOT's path: the isolated one differs in every build
    kept = [o for o in options if not o.startswith("-DMLX_ROOT")]
    for part in [sys.version, sys.executable, mlx_version, nanobind.__version__, *kept]:
        key.update(part.encode() + b"\0")
    for f in sorted((ROOT / "csrc").rglob("*")):
        if f.is_file() and f.suffix in (".cpp", ".h", ".txt"):
            key.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return options, key.hexdigest()


def _modules(folder: Path) -> list[Path]:
    return sorted(folder.glob(NAME + "*.so")) + sorted(folder.glob(NAME + "*.pyd"))


def build_kernels(out_dir: Path, reuse: bool) -> tuple[Path, bool]:
    """Configure and build csrc/ in a temporary folder, the module copied into ``out_dir``;
    with ``reuse``, one built there before from the same sources, mlx, nanobind and Python
    is kept (an editable install run again). Returns the module and whether it was built."""
    options, key = _configure_options()
    stamp = out_dir / STAMP
    old = _modules(out_dir)
    if reuse and len(old) == 1 and stamp.is_file() and stamp.read_text().strip() == key:
        return old[0], False
    for f in [*old, stamp]:
        f.unlink(missing_ok=True)  # a previous build's, maybe for another mlx
    with tempfile.TemporaryDirectory(prefix="mlxinfer-kernels-") as tmp:
        _run(["cmake", "-S", str(ROOT / "csrc"), "-B", tmp, *options], "cmake configure")
        jobs = str(os.cpu_count() or 1)
        _run(["cmake", "--build", tmp, "-j", jobs], "cmake build")
        built = _modules(Path(tmp))
        if not built:
            raise NotBuilt(f"the build made no {NAME} module")
        out_dir.mkdir(parents=True, exist_ok=True)
        target = out_dir / built[0].name
        shutil.copyfile(built[0], target)
    if reuse:
        stamp.write_text(key + "\n")
    return target, True


class BuildKernels(build_ext):
    """build_ext for the one pseudo-extension below: CMake, never a failed install."""

    def run(self):
        editable = bool(self.editable_mode or self.inplace)
        if editable:  # the source tree's folder (load() looks there)
            out_dir = Path(self.get_finalized_command("build_py").get_package_dir(PACKAGE))
            out_dir = ROOT / out_dir if not out_dir.is_absolute() else out_dir
        else:
            out_dir = Path(self.build_lib, *PACKAGE.split("."))
        (out_dir / NOT_BUILT).unlink(missing_ok=True)
        start = time.monotonic()
        try:
            target, built = build_kernels(out_dir, reuse=editable)
        except Exception as e:  # any failure: the package installs without them
            for f in [*_modules(out_dir), out_dir / STAMP]:
                f.unlink(missing_ok=True)  # not one built for another mlx or other sources
            why = f"kernels not built at install ({' '.join(str(e).split())})"
            print(f"mlxinfer: {why}; installing without them", file=sys.stderr, flush=True)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / NOT_BUILT).write_text(why + "\n", encoding="utf-8")
            self._outputs = [str(out_dir / NOT_BUILT)]
            return
        done = f"built in {time.monotonic() - start:.0f} s" if built else "up to date"
        print(f"mlxinfer: compiled CPU kernels {done}: {target}", file=sys.stderr, flush=True)
        self._outputs = [str(target)]

    def get_outputs(self):
        return list(getattr(self, "_outputs", []))

    def get_output_mapping(self):
        return {}


setup(
    # A placeholder: it makes setuptools run build_ext and tag the wheel for this platform;
    # BuildKernels builds csrc/ with CMake instead of compiling these (no) sources.
    ext_modules=[Extension(f"{PACKAGE}.{NAME}", sources=[])],
    cmdclass={"build_ext": BuildKernels},
)
