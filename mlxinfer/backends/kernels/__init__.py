"""The compiled CPU kernels (``csrc/``): a quantized and an f32 matrix × vector product,
vectorised (AVX-512 / AVX2+FMA, chosen at run time) and threaded, as MLX primitives.

Optional: a machine without a C++ compiler and CMake runs without them, on MLX's own
ops. :func:`load` finds the extension module (``_mlxinfer_kernels``) and imports it once;
where it is missing, or was built against another MLX (its import refuses), it returns
``None`` and :func:`reason` says why in one line; so where it is another checkout's (its
bindings' version, ``api``, is not :data:`API`). The CPU backend (``backends.cpu``) calls
them; model modules never import this package.

Where the module is looked for, in order: ``$MLXINFER_KERNELS_DIR``; this package's own
folder (an install that built them); a source checkout's ``build/kernels``
(``tools/build_kernels.py``). ``MLXINFER_KERNELS=0`` turns them off. ``pip install`` builds
them into this folder where it can (``setup.py``), else leaves its reason here (``NOT_BUILT``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from pathlib import Path
from types import ModuleType

import mlx.core as mx  # the extension links libmlx and uses mlx.core's array type

from ...errors import ConfigError

ENV = "MLXINFER_KERNELS"  # "0": never use the kernels
ENV_DIR = "MLXINFER_KERNELS_DIR"  # a folder holding _mlxinfer_kernels*.so
# cap the instruction set: scalar, avx2, avxvnni (AVX2 with AVX-VNNI), avx512bw (AVX-512 F/BW,
# without VNNI: Skylake-SP), avx512vnni (AVX-512 with VNNI, without VBMI: Cascade Lake), avx512,
# neon, best
ENV_ISA = "MLXINFER_KERNELS_ISA"
# "1": int8 activations in the int16 products where the kernels have them (an accuracy trade,
# off by default: docs/configuration.md, docs/performance.md)
ENV_INT8 = "MLXINFER_INT8_ACTIVATIONS"
NAME = "_mlxinfer_kernels"
# The bindings' version this package calls (csrc/src/bindings.cpp's ``api``): a module built from
# another checkout is refused at load, not met mid-decode by a missing function
API = 3
NOT_BUILT = NAME + ".not-built"  # an install's one line saying why it did not build them

_loaded: tuple[ModuleType | None, str | None] | None = None


def candidates() -> list[Path]:
    """The folders searched for the module, in order."""
    dirs = []
    if os.environ.get(ENV_DIR):
        dirs.append(Path(os.environ[ENV_DIR]))
    here = Path(__file__).resolve().parent
    dirs.append(here)
    checkout = here.parents[2]
    if (checkout / "csrc" / "CMakeLists.txt").is_file():
        dirs.append(checkout / "build" / "kernels")
    return dirs


def _find() -> Path | None:
    for d in candidates():
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            p = d / (NAME + suffix)
            if p.is_file():
                return p
    return None


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> ModuleType | None:
    """The kernels' module, or None where they are off, not built or refuse this MLX."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return _loaded[0]


def reason() -> str | None:
    """Why :func:`load` gives None, in one line (None where the kernels are loaded)."""
    load()
    return _loaded[1]


def _load() -> tuple[ModuleType | None, str | None]:
    if os.environ.get(ENV, "") == "0":
        return None, f"kernels off ({ENV}=0)"
    path = _find()
    if path is None:
        note = Path(__file__).resolve().parent / NOT_BUILT
        if note.is_file():  # the install tried and said why (setup.py)
            why = note.read_text(encoding="utf-8", errors="replace").strip().splitlines()
            if why:
                return None, f"{why[0]}; MLX's own ops are used"
        where = ", ".join(str(d) for d in candidates())
        return None, f"kernels not built (no {NAME} module in {where}); MLX's own ops are used"
    try:
        module = _import(path)
    except ImportError as e:  # built against another MLX: the module's own check
        return (
            None,
            f"kernels at {path} not usable: {str(e).splitlines()[0]}; MLX's own ops are used",
        )
    except OSError as e:
        return None, f"kernels at {path} did not load: {e}; MLX's own ops are used"
    if getattr(module, "api", None) != API:
        return (
            None,
            f"kernels at {path} are another version's (bindings {getattr(module, 'api', 0)}, "
            f"this mlxinfer calls {API}): rebuild them (pip install -e . or python3 "
            "tools/build_kernels.py); MLX's own ops are used",
        )
    cap = os.environ.get(ENV_ISA, "")
    if cap:  # a lower instruction set than the CPU's: another machine's paths, here
        try:
            module.set_max_isa(cap)
        except ValueError as e:
            raise ConfigError(f"{ENV_ISA}={cap!r}: {str(e).split(': ', 1)[-1]}") from None
    int8 = os.environ.get(ENV_INT8, "").strip()
    if int8 not in ("", "0", "1"):
        raise ConfigError(f"{ENV_INT8}={int8!r}: expected 0 or 1")
    module.set_int8_activations(int8 == "1")
    return module, None


def level(k: ModuleType) -> str:
    """The kernels' instruction set now: ``k.isa()``, with ``+avxvnni`` where the AVX2 paths
    also run AVX-VNNI (``k.avx_vnni_available``: Intel's client cores since Alder Lake), or
    ``avx512vnni`` where AVX-512 runs with VNNI but not VBMI (Cascade Lake: the tiles' 512-bit
    path, not the int16 kernel's), ``avx512bw`` where it runs without VNNI (Skylake-SP: the
    512-bit tiles with ``vpmaddwd`` and ``vpaddd``)."""
    avx_vnni = getattr(k, "avx_vnni_available", None)
    if avx_vnni is not None and avx_vnni():
        return k.isa() + "+avxvnni"
    wide = getattr(k, "tiles_wide_available", None)
    if k.isa() == "avx512" and wide is not None and wide() and not k.vnni_available():
        wide_vnni = getattr(k, "tiles_wide_vnni", None)
        return "avx512vnni" if wide_vnni is None or wide_vnni() else "avx512bw"
    return k.isa()


def int8_on(k: ModuleType) -> bool:
    """Whether int8 activations run: asked for (MLXINFER_INT8_ACTIVATIONS=1) and a tiled path
    has them here (``k.tiles_int8_available``)."""
    return bool(k.int8_activations() and k.tiles_int8_available())


def describe() -> str:
    """One line for ``--verbose``: the kernels in use (instruction set, threads) or why not."""
    k = load()
    if k is None:
        return reason()
    int8 = ", int8 activations" if int8_on(k) else ""
    return (
        f"kernels: {level(k)}{int8} on {k.num_threads()} threads "
        f"(MLX {k.mlx_version}, {mx.__version__})"
    )
