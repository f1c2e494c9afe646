"""The one noxfile of the monorepo.

Packages are discovered from ``packages/*/pyproject.toml``: adding a package adds a folder, not
a list entry. Each package's test session installs only that package, the local packages it
declares (resolved to their folders) and the root ``test`` dependency group, so it proves the
package installs on its own.

Per-package knobs live in the package's own ``pyproject.toml`` under ``[tool.ortmodule]``:

- ``test-extras``: extras installed for its test session (for example ``["cpu", "test"]``).
- ``typecheck``: ``"strict"`` once the package is ready for ``mypy --strict``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import nox
import tomllib

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
CONSTRAINTS = ROOT / "constraints.txt"
META = "ortmodule"

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "versions", "typecheck", "tests", "integration"]


def _pip_find_links() -> str | None:
    """pip's configured find-links: uv does not read pip's configuration, so hand it over."""
    found = os.environ.get("PIP_FIND_LINKS")
    if found:
        return found
    try:
        out = subprocess.run(
            ["python3", "-m", "pip", "config", "get", "global.find-links"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        return None
    return out or None


_FIND_LINKS = _pip_find_links()
if _FIND_LINKS and "UV_FIND_LINKS" not in os.environ:
    # uv takes a space separated list, pip may give several lines.
    os.environ["UV_FIND_LINKS"] = " ".join(_FIND_LINKS.split())


def _pyproject(path: Path) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def _discover() -> dict[str, Path]:
    found = {}
    for pp in sorted(PACKAGES_DIR.glob("*/pyproject.toml")):
        found[_pyproject(pp)["project"]["name"]] = pp.parent
    return found


PACKAGES = _discover()
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(\[([^\]]*)\])?")


def _split_req(req: str) -> tuple[str, list[str]]:
    m = _REQ_NAME.match(req.split(";")[0])
    assert m, req
    extras = [e.strip() for e in (m.group(3) or "").split(",") if e.strip()]
    return m.group(1).lower().replace("_", "-"), extras


def _local_install_args(name: str, extras: list[str]) -> list[str]:
    """Path requirements for ``name[extras]`` and every local package it needs, transitively."""
    wanted: dict[str, set[str]] = {}
    todo = [(name, list(extras))]
    while todo:
        pkg, pkg_extras = todo.pop()
        seen = wanted.setdefault(pkg, set())
        new = set(pkg_extras) - seen
        if seen and not new:
            continue
        seen.update(pkg_extras)
        meta = _pyproject(PACKAGES[pkg] / "pyproject.toml")["project"]
        reqs = list(meta.get("dependencies", []))
        for extra in pkg_extras:
            reqs += meta.get("optional-dependencies", {}).get(extra, [])
        for req in reqs:
            dep, dep_extras = _split_req(req)
            if dep in PACKAGES:
                todo.append((dep, dep_extras))
    args = []
    for pkg, pkg_extras in sorted(wanted.items()):
        path = str(PACKAGES[pkg].relative_to(ROOT))
        args.append(f"./{path}[{','.join(sorted(pkg_extras))}]" if pkg_extras else f"./{path}")
    return args


def _knobs(name: str) -> dict:
    return _pyproject(PACKAGES[name] / "pyproject.toml").get("tool", {}).get("ortmodule", {})


def _install(session: nox.Session, *args: str, groups: tuple[str, ...] = ()) -> None:
    reqs = list(args)
    for group in groups:
        reqs += nox.project.dependency_groups(_pyproject(ROOT / "pyproject.toml"), group)
    session.install("-c", str(CONSTRAINTS), *reqs)


def _all_packages_args() -> list[str]:
    args: list[str] = []
    for name in PACKAGES:
        for arg in _local_install_args(name, list(_knobs(name).get("test-extras", []))):
            if arg not in args:
                args.append(arg)
    # one folder may appear with and without extras; keep the richest
    by_path: dict[str, str] = {}
    for arg in args:
        path = arg.split("[")[0]
        if len(arg) > len(by_path.get(path, "")):
            by_path[path] = arg
    return sorted(by_path.values())


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    _install(session, groups=("lint",))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
def versions(session: nox.Session) -> None:
    """Every package shares one version; the meta-package pins each component with ==."""
    found = {
        name: _pyproject(path / "pyproject.toml")["project"]["version"]
        for name, path in PACKAGES.items()
    }
    if len(set(found.values())) != 1:
        session.error(f"packages disagree on the version: {found}")
    version = next(iter(found.values()))
    if META in PACKAGES:
        meta = _pyproject(PACKAGES[META] / "pyproject.toml")["project"]
        extras = meta.get("optional-dependencies", {}).values()
        for req in [*meta.get("dependencies", []), *(r for reqs in extras for r in reqs)]:
            dep, _ = _split_req(req)
            if dep in PACKAGES and f"=={version}" not in req.replace(" ", ""):
                session.error(f"{META} must pin {dep}=={version}, found {req!r}")
    session.log(f"{len(found)} packages at version {version}")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every package; strict where the package says it is ready."""
    _install(session, *_all_packages_args(), groups=("typecheck",))
    for name, path in PACKAGES.items():
        src = str(path / "src")
        flags = ["--strict"] if _knobs(name).get("typecheck") == "strict" else []
        session.run("mypy", *flags, src)


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, in an environment holding only that package and what it declares."""
    extras = list(_knobs(package).get("test-extras", []))
    _install(session, *_local_install_args(package, extras), groups=("test",))
    session.run(
        "pytest", str(PACKAGES[package] / "tests"), *session.posargs, env={"PYTHONHASHSEED": "0"}
    )


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-package, end-to-end tests with every package installed."""
    _install(session, *_all_packages_args(), groups=("test",))
    tests_dir = ROOT / "integration_tests"
    if not any(tests_dir.glob("test_*.py")):
        session.skip("no integration tests yet")
    session.run("pytest", str(tests_dir), *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """The differential fuzzer: random programs in eager and under ORTModule, compared.

    ``nox -s fuzz`` runs 3000 programs; arguments go to ``python -m ortmodule_testing.fuzz``
    (``nox -s fuzz -- --programs 200 --seed 7 --out fuzz-out``).
    """
    _install(session, *_all_packages_args(), groups=("test",))
    args = session.posargs or ["--programs", "3000", "--seed", "0", "--out", "fuzz-out"]
    session.run("python", "-m", "ortmodule_testing.fuzz", *args)


@nox.session
def models(session: nox.Session) -> None:
    """Coverage of all of transformers: every model type of its auto mappings, tiny, trained in
    eager and under ORTModule; writes docs/models.md. Hours on a small CPU machine.

    Arguments go to ``python -m ortmodule_testing.hf_coverage``
    (``nox -s models -- --only llama bert --out /tmp/models.md``).
    """
    _install(session, *_all_packages_args(), groups=("test",))
    args = session.posargs or ["--out", "docs/models.md", "--results", "docs/models.jsonl"]
    session.run("python", "-m", "ortmodule_testing.hf_coverage", *args)


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark suite: writes benchmarks/results/<date>-<machine>.md."""
    _install(session, *_all_packages_args(), groups=("bench",))
    session.run("python", "-m", "benchmarks", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: train the demo model under eager and under ORTModule, side by side."""
    if META in PACKAGES:
        _install(session, *_local_install_args(META, ["cpu", "demo"]))
        session.run("ortmodule", "demo", *session.posargs)
    else:
        _install(session, *_local_install_args("ortmodule-pytree", []))
        session.run("python", "tools/pytree_example.py")


@nox.session(venv_backend="none")
def dev(session: nox.Session) -> None:
    """Make .venv with every package editable plus every tool: ``nox -s dev``."""
    venv = ROOT / ".venv"
    uv = shutil.which("uv") or "uv"
    if not venv.exists():
        session.run(uv, "venv", str(venv))
    py = str(venv / "bin" / "python")
    editable = []
    for arg in _all_packages_args():
        editable += ["-e", arg]
    groups = []
    for group in ("test", "lint", "typecheck", "bench"):
        groups += nox.project.dependency_groups(_pyproject(ROOT / "pyproject.toml"), group)
    session.run(
        uv, "pip", "install", "--python", py, "-c", str(CONSTRAINTS), *editable, *groups, "nox"
    )
    session.log(f"ready: source {venv}/bin/activate")


@nox.session
def frontends(session: nox.Session) -> None:
    """The two exporter frontends side by side: writes docs/frontends.md and docs/frontends.json.

    Arguments go to ``python -m ortmodule_testing.frontends``
    (``nox -s frontends -- --parts timing``, ``-- --render-only``).
    """
    _install(session, *_all_packages_args(), groups=("test",))
    session.run("python", "-m", "ortmodule_testing.frontends", *session.posargs)
