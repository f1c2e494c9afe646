"""The repository's layout: no import cycle inside any package, and package imports point one way.

Every package under ``packages/`` (``src/<import name>/``) and the ``benchmarks`` package are read
from the source with ``ast``, so the test sees every import, taken or not, and needs nothing
installed. A module depends on the modules it imports (at module level, inside ``if
TYPE_CHECKING:``, and inside functions and classes alike: a function-level import only delays the
dependency, it does not remove it, and the design rule is that no import is moved into a function
to dodge a cycle) and on their packages' ``__init__`` (Python runs a package's ``__init__`` before
any of its modules; the importer's own packages are already running, unless it imports a name
from one of them, which reads that ``__init__``).

Between packages (see docs/architecture.md): ``ortmodule_pytree`` <- ``ortmodule_exporter`` <-
components <- ``ortmodule``. A component (any other package) imports only the core packages and
never the runtime ``ortmodule`` nor another component; ``ortmodule_testing`` is dev only: no
package imports it (nor ``benchmarks``); and a package imports only the packages its
``pyproject.toml`` declares.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
RUNTIME = "ortmodule"
CORE = ("ortmodule_pytree", "ortmodule_exporter")
DEV_ONLY = ("ortmodule_testing", "benchmarks")
# Packages whose own modules are all imported at module level (docs/architecture.md says so for
# the exporter; elsewhere a function-level import defers an optional heavy dependency such as
# Triton or DeepSpeed, and the cycle check still counts it).
NO_FUNCTION_LEVEL_IMPORTS = ("ortmodule_exporter",)
# Modules that import nothing of ours but each other: the engine's binding, the component
# protocol (components, and option: how a component declares its variables), the ordered
# registry every plug-in kind uses, the export configuration in force, the shim around
# PyTorch's private TorchScript exporter and the exceptions.
LEAVES = (
    "ortmodule_exporter.engine_binding",
    "ortmodule_exporter.components",
    "ortmodule_exporter.ordered",
    "ortmodule_exporter.active_export",
    "ortmodule_exporter.torchscript_onnx",
    "ortmodule_exporter.option",
    "ortmodule_exporter.errors",
)
UNDECLARED = "not declared in its pyproject.toml; installed alone, the import fails"


@dataclass
class Package:
    """One import package: its modules, and the local distributions it declares."""

    name: str
    root: Path
    declared: set[str] = field(default_factory=set)
    modules: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for path in sorted(self.root.rglob("*.py")):
            parts = (self.name, *path.relative_to(self.root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            self.modules[".".join(parts)] = path


@dataclass(frozen=True)
class Import:
    """One import statement of ours: where it is, whether it runs with the module, what it names."""

    module: str
    where: str
    nested: bool
    targets: tuple[str, ...]


def _import_name(req: str) -> str:
    name = req.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0]
    return name.strip().lower().replace("-", "_")


def discover(packages_dir: Path) -> dict[str, Package]:
    """Every ``packages/<dist>/src/<import name>`` and what its ``pyproject.toml`` declares."""
    found: dict[str, Package] = {}
    for pyproject in sorted(packages_dir.glob("*/pyproject.toml")):
        with open(pyproject, "rb") as f:
            project = tomllib.load(f)["project"]
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs += extra
        declared = {_import_name(r) for r in reqs}
        for init in sorted((pyproject.parent / "src").glob("*/__init__.py")):
            found[init.parent.name] = Package(init.parent.name, init.parent, declared)
    return found


def _targets(
    package_of: str, node: ast.Import | ast.ImportFrom, known: dict[str, Path]
) -> list[str]:
    """The modules of ours (``known``) that ``node`` (in a module of ``package_of``) names."""
    roots = {name.split(".")[0] for name in known}
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in roots]
    if node.level:
        base = package_of.split(".")
        base = base[: len(base) - node.level + 1]
        source = ".".join([*base, node.module] if node.module else base)
    else:
        source = node.module or ""
    if source.split(".")[0] not in roots:
        return []
    # ``from package import name``: name is a module when there is one by that name
    submodules = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known]
    if len(submodules) == len(node.names):
        return submodules  # only modules: the package's __init__ runs, nothing is read from it
    return [source, *submodules]


def imports(module: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every import of ours in ``module`` (``known``: all our modules, by dotted name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package_of = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _targets(package_of, child, known)
                if targets:
                    where = f"{_shown(path)}:{child.lineno}"
                    found.append(Import(module, where, nested, tuple(targets)))
            inner = nested or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
            )
            visit(child, inner)

    visit(tree, False)
    return found


def _shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def read_imports(known: dict[str, Path]) -> dict[str, list[Import]]:
    """The imports of ours in every module of ``known``."""
    return {module: imports(module, path, known) for module, path in known.items()}


def module_graph(package: Package, found: dict[str, list[Import]]) -> dict[str, set[str]]:
    """Edges between the modules of one package, from every import (function level included).

    ``found``: the imports of each module, as :func:`imports` reads them.
    """
    graph: dict[str, set[str]] = {}
    for module in package.modules:
        own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        edges: set[str] = set()
        for imp in found[module]:
            for target in imp.targets:
                parts = target.split(".")
                if parts[0] != package.name:
                    continue
                # importing a.b.c runs a.b's __init__ first, unless the importer is inside a.b;
                # the named module itself counts even when it is one of the importer's own
                # packages (``from a.b import name`` reads a.b's __init__)
                for i in range(1, len(parts) + 1):
                    name = ".".join(parts[:i])
                    if name in package.modules and (name not in own_packages or i == len(parts)):
                        edges.add(name)
        graph[module] = edges - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the nodes in import order, first repeated last; None if none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles of ``graph`` until none is left: each found one loses its closing edge."""
    remaining = {node: set(targets) for node, targets in graph.items()}
    cycles = []
    while (cycle := find_cycle(remaining)) is not None:
        cycles.append(cycle)
        remaining[cycle[-2]].discard(cycle[-1])
    return cycles


def _where(found: dict[str, list[Import]], cycle: list[str]) -> str:
    """The import lines that make each edge of ``cycle``."""
    lines = []
    for a, b in zip(cycle, cycle[1:], strict=False):
        for imp in found[a]:
            if any(t == b or t.startswith(b + ".") for t in imp.targets):
                kind = " (inside a function or class)" if imp.nested else ""
                lines.append(f"  {a} -> {b}: {imp.where}{kind}")
                break
        else:
            lines.append(f"  {a} -> {b}: runs {b} (a package __init__)")
    return "\n".join(lines)


def cycle_report(package: Package, found: dict[str, list[Import]]) -> str:
    """Every import cycle of ``package``, its modules in order and the line of each import."""
    return "\n".join(
        f"import cycle in {package.name}: " + " -> ".join(cycle) + "\n" + _where(found, cycle)
        for cycle in find_cycles(module_graph(package, found))
    )


def package_violations(packages: dict[str, Package], found: dict[str, list[Import]]) -> list[str]:
    """Imports between packages that point the wrong way or name an undeclared package."""
    problems = []
    for package in packages.values():
        for module in package.modules:
            for imp in found[module]:
                for other in sorted({t.split(".")[0] for t in imp.targets} - {package.name}):
                    rule = _package_rule(package, other)
                    if rule:
                        problems.append(f"{imp.where}: {package.name} imports {other}: {rule}")
    return problems


def _package_rule(package: Package, other: str) -> str | None:
    if other in DEV_ONLY and package.name not in DEV_ONLY:
        return f"{other} is dev only; no package imports it"
    if package.name in DEV_ONLY:
        # run with everything installed; declaring the runtime would make a dependency cycle
        return None
    if package.name == RUNTIME:
        return None if other in package.declared else UNDECLARED
    if other == RUNTIME:
        return "only tests and benchmarks import the runtime; a component plugs in by entry point"
    if package.name in CORE:
        below = CORE[: CORE.index(package.name)]
        if other not in below:
            return f"{package.name} may import only {list(below) or 'nothing of ours'}"
    elif other not in CORE:
        return f"a component imports only {list(CORE)}, never another component"
    return None if other in package.declared else UNDECLARED


def _repository() -> tuple[dict[str, Package], dict[str, Path]]:
    packages = discover(REPO / "packages")
    packages["benchmarks"] = Package("benchmarks", REPO / "benchmarks")
    known = {m: p for package in packages.values() for m, p in package.modules.items()}
    return packages, known


PACKAGES, KNOWN = _repository()
FOUND = read_imports(KNOWN)


def test_every_package_is_read() -> None:
    dists = list((REPO / "packages").glob("*/pyproject.toml"))
    assert len(PACKAGES) == len(dists) + 1, sorted(PACKAGES)
    for package in PACKAGES.values():
        assert package.modules, package.name
    for sub in ("export", "symbolics", "passes", "python_op", "aten"):
        assert f"ortmodule_exporter.{sub}" in KNOWN, sub
    assert len(PACKAGES["ortmodule_exporter"].modules) > 30


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_no_import_cycle(name: str) -> None:
    report = cycle_report(PACKAGES[name], FOUND)
    if report:
        pytest.fail(report, pytrace=False)


def test_package_imports_point_one_way() -> None:
    problems = package_violations(PACKAGES, FOUND)
    assert not problems, "imports between packages against the layout:\n" + "\n".join(problems)


def test_no_function_level_import_where_the_package_forbids_it() -> None:
    nested = [
        f"{imp.where} imports {imp.targets[0]}"
        for name in NO_FUNCTION_LEVEL_IMPORTS
        for module in PACKAGES[name].modules
        for imp in FOUND[module]
        if imp.nested
    ]
    assert not nested, "imports of ours inside a function or class:\n" + "\n".join(nested)


@pytest.mark.parametrize("module", LEAVES)
def test_leaf_modules_import_nothing_of_ours(module: str) -> None:
    # a leaf's own package __init__ is already running when it is imported (see the top)
    outside = {t for imp in FOUND[module] for t in imp.targets} - set(LEAVES)
    assert not outside, f"{module} imports {sorted(outside)}"


# -- the checker itself ------------------------------------------------------------------------


def test_the_checker_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    two = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}
    assert find_cycles(two) == [["a", "b", "a"], ["c", "d", "c"]]
    assert two["b"] == {"a"}, "the graph is left as it was"


def _fake(tmp_path: Path, files: dict[str, str]) -> tuple[Package, dict[str, list[Import]]]:
    """A package ``fakepkg`` made of ``files`` (path: text), and its imports (ours included)."""
    for name, text in files.items():
        path = tmp_path / "fakepkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    package = Package("fakepkg", tmp_path / "fakepkg")
    return package, read_imports({**KNOWN, **package.modules})


def test_the_checker_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    package, found = _fake(
        tmp_path,
        {
            "__init__.py": "from fakepkg.registry import register\n",
            "registry.py": "def load():\n    from fakepkg import builtins\n",
            "builtins.py": "from fakepkg.registry import register\n",
            "leaf.py": "import os\n",
        },
    )
    assert find_cycle(module_graph(package, found)) == [
        "fakepkg.registry",
        "fakepkg.builtins",
        "fakepkg.registry",
    ]
    report = cycle_report(package, found).splitlines()
    assert report[0] == (
        "import cycle in fakepkg: fakepkg.registry -> fakepkg.builtins -> fakepkg.registry"
    )
    assert report[1].endswith("registry.py:2 (inside a function or class)"), report
    assert report[2].endswith("builtins.py:1"), report
    assert len(report) == 3


def test_the_checker_finds_a_cycle_through_type_checking_and_relative_imports(
    tmp_path: Path,
) -> None:
    package, found = _fake(
        tmp_path,
        {
            "__init__.py": "",
            "sub/__init__.py": "from .kernel import step\n",
            "sub/kernel.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from ..optimizer import Bucket\n"
            ),
            "optimizer.py": "from fakepkg.sub.kernel import step\n",
        },
    )
    # optimizer -> sub (its __init__ runs first) -> sub.kernel -> optimizer
    assert find_cycle(module_graph(package, found)) == [
        "fakepkg.optimizer",
        "fakepkg.sub",
        "fakepkg.sub.kernel",
        "fakepkg.optimizer",
    ]


def test_the_checker_counts_a_name_read_from_the_own_package(tmp_path: Path) -> None:
    package, found = _fake(
        tmp_path,
        {"__init__.py": "from fakepkg.a import f\nX = 1\n", "a.py": "from fakepkg import X\n"},
    )
    assert find_cycle(module_graph(package, found)) == ["fakepkg", "fakepkg.a", "fakepkg"]


def test_the_checker_sees_no_cycle_where_there_is_none(tmp_path: Path) -> None:
    package, found = _fake(
        tmp_path,
        {
            "__init__.py": "from fakepkg.a import f\nfrom fakepkg import b\n",
            "a.py": "from fakepkg.b import g\n",
            "b.py": "def g():\n    import os\n",
        },
    )
    assert find_cycle(module_graph(package, found)) is None


def test_the_checker_names_a_component_importing_the_runtime(tmp_path: Path) -> None:
    component, found = _fake(tmp_path, {"__init__.py": "def f():\n    import ortmodule\n"})
    component.declared = {"ortmodule"}
    problems = package_violations({"fakepkg": component}, found)
    assert len(problems) == 1 and "fakepkg imports ortmodule: only tests" in problems[0]
    assert _package_rule(component, "ortmodule_triton") is not None
    assert _package_rule(component, "ortmodule_testing") is not None
    assert _package_rule(PACKAGES["ortmodule_pytree"], "ortmodule_exporter") is not None
