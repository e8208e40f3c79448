"""No import circle anywhere in `megatron_spec`: the package's import graph, read from the source, is acyclic.

Every `import` / `from ... import` counts, at module level and inside functions alike: a lazy import still makes
two modules depend on each other (the simulator's `config -> hardware -> cpu_profile -> cpu_eager -> cpu_train ->
config` circle ran through function-level imports). `from pkg import name` is an edge to `pkg.name` when that is a
module, else to `pkg`; `from . import sub` within a package is an edge to the submodule only (the package's own
`__init__` is already executing); importing a submodule is also an edge to each package it lives in (their
`__init__` runs first), except the importer's own. The second test shows the finder is able to fail: a two-module circle written
to a temporary package is found and named.
"""

import ast
from pathlib import Path

import megatron_spec

ROOT = Path(megatron_spec.__file__).parent


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(root: Path, path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports, anywhere in the file."""
    name = module_name(root, path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
            out.update(subs)
            if len(subs) < len(node.names) and mod in modules:
                out.add(mod)
    # Importing `a.b.c` first runs `a/__init__` and `a/b/__init__`: those are edges too, except to the importer's
    # own enclosing packages, which are already executing when it runs.
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    for mod in list(out):
        parts = mod.split(".")
        out.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in modules and p not in own)
    out.discard(name)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    files = {module_name(root, p): p for p in root.rglob("*.py")}
    return {m: imports_of(root, p, set(files)) for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative), each sorted."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_package_has_no_import_circle():
    graph = import_graph(ROOT)
    assert len(graph) > 50 and "megatron_spec.sim.config" in graph["megatron_spec.sim.pipeline"]
    assert cycles(graph) == []


def test_finder_names_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("def f():\n    from .sub.b import g\n")  # lazy, still an edge
    (pkg / "sub" / "b.py").write_text("from ..a import f\nimport os\n")
    (pkg / "c.py").write_text("from pkg import a\n")  # depends on the circle, is not part of it
    # pkg.sub joins the circle: importing pkg.sub.b from pkg.a runs pkg/sub/__init__ first, which imports b
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.sub", "pkg.sub.b"]]


def test_finder_sees_a_circle_through_a_package_init(tmp_path):
    """`x.m` imports `y.leaf`, which imports nothing of `x`; but `y/__init__` imports `y.top`, which imports `x.m`.
    Importing `x.m` first then fails with a partially initialised module: a circle through `y`'s `__init__`."""
    pkg = tmp_path / "pkg"
    for d in ("x", "y"):
        (pkg / d).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "x" / "__init__.py").write_text("")
    (pkg / "x" / "m.py").write_text("from ..y.leaf import K\n")
    (pkg / "y" / "__init__.py").write_text("from .top import T\n")
    (pkg / "y" / "top.py").write_text("from ..x.m import M\n")
    (pkg / "y" / "leaf.py").write_text("K = 1\n")
    assert cycles(import_graph(pkg)) == [["pkg.x.m", "pkg.y", "pkg.y.top"]]



ADAPTERS = {"megatron", "vllm", "export", "cost"}


def component(module: str) -> str:
    """The package a module belongs to, one level under the root (a top-level module is its own). A drafter's
    adapters (`drafters/<method>/{megatron,vllm,export,cost}.py`: to the Megatron trainer, vLLM and the simulator)
    are components of their own: they sit above what they plug into, which reaches them through the drafter
    registry by name."""
    parts = module.split(".")
    if len(parts) > 3 and parts[1] == "drafters" and parts[-1] in ADAPTERS:
        return "drafters/" + parts[-1]
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(component(m), set())
        out[component(m)] |= {component(d) for d in deps} - {component(m)}
    return out


def test_packages_have_no_import_circle():
    """The packages form a DAG, so each reads, tests and swaps out against the ones below it; the drafters, the
    interfaces, the trainers and the generators are packages of their own."""
    packages = package_graph(import_graph(ROOT))
    assert {"drafters", "interfaces", "trainers", "generators", "speculative", "rl", "drafters/megatron"} <= set(packages)
    assert cycles(packages) == []


def test_package_graph_sees_a_circle_between_packages(tmp_path):
    """Two packages whose modules import each other's, with no circle between modules, are a circle of packages."""
    pkg = tmp_path / "megatron_spec"
    for d in ("a", "b"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "low.py").write_text("X = 1\n")
    (pkg / "a" / "high.py").write_text("from ..b.mid import Y\n")
    (pkg / "b" / "mid.py").write_text("from ..a.low import X\nY = X\n")
    graph = import_graph(pkg)
    assert cycles(graph) == []
    assert cycles(package_graph(graph)) == [["a", "b"]]
