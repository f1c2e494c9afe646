"""The exporter's layout: its import graph has no cycle, and none is hidden in a function.

Read from the source with ``ast``, so the test sees every import, taken or not. A module depends
on the modules it imports at module level and on their packages' ``__init__`` (Python runs a
package's ``__init__`` before any of its modules; the importer's own packages are already
running). Imports for the type checker only (``if TYPE_CHECKING:``) count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ortmodule_exporter

PACKAGE = "ortmodule_exporter"
ROOT = Path(ortmodule_exporter.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of ours that ``node`` (in ``module``) names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
    if node.level:
        base = _package_of(module).split(".")
        base = base[: len(base) - node.level + 1]
        source = ".".join([*base, node.module] if node.module else base)
    else:
        source = node.module or ""
    if source.split(".")[0] != PACKAGE:
        return []
    # ``from package import name``: name is a module when there is one by that name
    submodules = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in MODULES]
    return [source, *submodules]


def _imports(module: str) -> tuple[set[str], list[str]]:
    """(modules imported at module level, imports of ours inside a function or class)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    top: set[str] = set()
    nested: list[str] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _targets(module, child)
                if in_function and targets:
                    nested.append(f"{MODULES[module]}:{child.lineno} imports {targets[0]}")
                elif not in_function:
                    top.update(targets)
            inner = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
            )
            visit(child, inner)

    visit(tree, False)
    return top, nested


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        edges = set()
        for target in _imports(module)[0]:
            parts = target.split(".")
            # importing a.b.c runs a.b's __init__ first, unless the importer is inside a.b
            for i in range(2, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in MODULES and name not in own_packages:
                    edges.add(name)
        graph[module] = edges - {module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_the_layout_is_read_from_subpackages() -> None:
    for package in ("export", "symbolics", "passes", "python_op", "aten"):
        assert f"{PACKAGE}.{package}" in MODULES, package
    assert len(MODULES) > 30


def test_no_import_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_function_level_import_of_our_modules() -> None:
    nested = [line for module in MODULES for line in _imports(module)[1]]
    assert not nested, "imports of ours inside a function or class:\n" + "\n".join(nested)


def test_engine_binding_is_a_leaf() -> None:
    top, nested = _imports(f"{PACKAGE}.engine_binding")
    assert not top and not nested


def test_the_checker_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
