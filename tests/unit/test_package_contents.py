"""The installed package is the library alone: the benchmarks (and the mpi4py, DDP and
Keras baselines they time) live in the repository's bench/, which pyproject's package
list leaves out of the wheel, and nothing in hvdlite imports them (every import
statement, also those inside functions)."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hvdlite"


def _imports(path: Path) -> set[str]:
    """Every module one file imports, by its full name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_no_module_of_the_package_imports_the_benchmarks() -> None:
    wrong = sorted(f"{path.relative_to(ROOT)} imports {name}"
                   for path in PACKAGE.rglob("*.py") for name in _imports(path)
                   if name == "bench" or name.startswith("bench."))
    assert not wrong, wrong


def test_no_benchmark_is_in_the_package() -> None:
    named = sorted(str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*")
                   if "bench" in path.name and "__pycache__" not in path.parts)
    assert not named, f"benchmarks belong in the repository's bench/, not in hvdlite/: {named}"


def test_the_wheel_holds_hvdlite_alone() -> None:
    """The packages setuptools puts in the wheel, found as pyproject.toml tells it to."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = found["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = setuptools.find_packages(where=str(ROOT), include=include)
    assert packages and "hvdlite" in packages
    outside = sorted(p for p in packages if p.split(".")[0] != "hvdlite")
    assert not outside, f"the wheel would hold packages besides hvdlite: {outside}"
    assert (ROOT / "bench" / "__main__.py").is_file()
