"""The package's shape: imports go one way.

Every import statement in ``mlxinfer/`` counts, at module level or inside a
function, under ``TYPE_CHECKING`` or not: a cycle anywhere means two modules
that cannot be understood (or changed) one without the other.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "mlxinfer"


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of the package at ``root`` it imports.

    ``from P import x`` imports the submodule ``P.x`` where there is one, and the package
    ``P``. Inside ``P`` (``P`` the importer's own package or an ancestor), naming a submodule
    (``from . import sibling``) is no dependency on ``P``: ``P`` is being imported already,
    its ``__init__`` perhaps not to the end. Any other name comes from ``P``'s ``__init__``
    and is one: ``from . import helper``, ``helper`` defined in the ``__init__``, is a cycle
    when that ``__init__`` imports the module back.
    """
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = (
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    if node.level
                    else []
                )
                target = ".".join(base + ([node.module] if node.module else []))
                if target not in modules:
                    continue
                submodules = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                found |= submodules
                if len(submodules) < len(node.names) or target not in ancestors:
                    found.add(target)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        graph[name] = found - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_finds_a_cycle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_name_from_the_packages_init_is_an_import_of_the_package(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a, b\n\ndef helper(): ...\n")
    (pkg / "a.py").write_text("from . import helper\n")  # pkg's own function: a cycle
    (pkg / "b.py").write_text("from . import a\nfrom .sub import c\n")  # submodules only
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import helper, b\n")  # an ancestor's name
    graph = import_graph(pkg)
    assert graph == {
        "pkg": {"pkg.a", "pkg.b"},
        "pkg.a": {"pkg"},
        "pkg.b": {"pkg.a", "pkg.sub", "pkg.sub.c"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg", "pkg.b"},
    }
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.sub.c"]]


def test_no_import_cycle_in_mlxinfer():
    graph = import_graph()
    assert "mlxinfer.generation.loop" in graph and graph["mlxinfer.generation.loop"]  # read
    assert cycles(graph) == []


def test_generation_is_one_way():
    """The loops import the shared types; nothing they produce imports them back."""
    graph = import_graph()
    assert graph["mlxinfer.generation.results"] == set()  # a leaf
    assert "mlxinfer.generation.loop" not in graph["mlxinfer.generation.speculative"]
    assert not any(m.startswith("mlxinfer.backends") for m in graph["mlxinfer.cache.prompt"])
    assert {"mlxinfer.generation.prefill", "mlxinfer.generation.results"} <= graph[
        "mlxinfer.generation.loop"
    ]
    assert {"mlxinfer.generation.prefill", "mlxinfer.generation.results"} <= graph[
        "mlxinfer.generation.speculative"
    ]


# The packages in pipeline order: a module may import its own package and those before it,
# never one after. Files and the machine first (importable before MLX), then the network and its
# caches, reading models in, what their text means, generating, batching, across ranks, the
# surfaces (app handle, server, benchmarks) and the command line last.
PACKAGE_ORDER = [
    "errors",
    "files",
    "platform",
    "cache",
    "models",
    "backends",
    "quant",
    "tokenization",
    "vision",
    "gguf",
    "loading",
    "store",
    "output",
    "generation",
    "quality",
    "training",
    "batch",
    "distributed",
    "embeddings",
    "handle",
    "app",
    "server",
    "bench",
    "cli",
    "__main__",
]


def layer_of(module: str) -> int:
    """The rank in PACKAGE_ORDER of the top-level package (or module) ``module`` belongs to;
    the package's own ``__init__`` (``mlxinfer``) sits above everything it lazily exports."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(PACKAGE_ORDER)
    return PACKAGE_ORDER.index(parts[1])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m)
    )


def test_every_top_level_module_has_a_place_in_the_order():
    tops = {m.split(".")[1] for m in import_graph() if "." in m}
    assert tops <= set(PACKAGE_ORDER), tops - set(PACKAGE_ORDER)
    single = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert len(single) <= 6, single  # packages, not a flat list of modules


def test_the_order_check_finds_an_upward_import():
    graph = {"mlxinfer.cache.kv": {"mlxinfer.batch.pool"}, "mlxinfer.batch.pool": set()}
    assert upward_imports(graph) == ["mlxinfer.cache.kv -> mlxinfer.batch.pool"]


def test_packages_import_in_pipeline_order():
    assert upward_imports(import_graph()) == []


# What a backend check looks like: asking which device runs, or the old per-call CPU switches.
# (Imports of mlxinfer.backends are checked on the import graph.)
BACKEND_CHECKS = (
    "default_device",
    "DeviceType",
    "mx.cpu",
    "mx.gpu",
    "use_cpu",
    "cpu_ops",
    "cpu_quant",
)


def test_the_models_never_ask_which_backend_runs_them():
    """Model code reads as it runs on Metal; a backend swaps its layers in at load."""
    graph = import_graph()
    models = [m for m in graph if m.startswith("mlxinfer.models")]
    assert len(models) > 15  # the families and the shared layers were read
    for name in models:
        assert not any(m.startswith("mlxinfer.backends") for m in graph[name]), name
        path = ROOT.parent / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT.parent / name.replace(".", "/") / "__init__.py"
        text = path.read_text(encoding="utf-8")
        found = [check for check in BACKEND_CHECKS if check in text]
        assert found == [], f"{path.name}: {found}"


def test_the_backend_check_finds_one():
    assert [c for c in BACKEND_CHECKS if c in "if mx.default_device() == mx.cpu:"] == [
        "default_device",
        "mx.cpu",
    ]


def test_every_relative_import_names_a_module():
    """``from .x import y`` inside a function is only run when called: check them all here."""
    modules = {
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts) for p in ROOT.rglob("*.py")
    }
    modules |= {m.removesuffix(".__init__") for m in modules}
    missing = []
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        package = parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                base = package[: len(package) - node.level + 1]
                target = ".".join((*base, node.module))
                if target not in modules:
                    missing.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {target}")
    assert missing == []


def test_the_tests_mirror_the_packages():
    """Each test file sits in the folder of the package it checks (or real/, hostile/ or app/);
    helpers in support/; only this file at the top."""
    tests = ROOT.parent / "tests"
    allowed = set(PACKAGE_ORDER) | {"real", "hostile", "app", "support", "fixtures", "templates"}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders <= allowed, folders - allowed
    top = sorted(p.name for p in tests.glob("*.py"))
    assert top == ["conftest.py", "test_layout.py"], top
    assert not list((tests / "support").glob("test_*.py"))
