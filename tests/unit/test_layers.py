"""Imports run one way, from the bindings down to the transports. Read from the source
(every import statement, also those inside functions and under TYPE_CHECKING), so a
lazy import that runs back up fails too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hvdlite"
# Top to bottom: a package may import only the ones listed after it.
LAYERS = ("keras", "tensorflow", "torch", "_keras", "common", "runner", "reducer", "elastic",
          "diagnostics", "api", "engine", "failure", "negotiation", "policy", "recording",
          "backends", "transport")
ABOVE = {package: set(LAYERS[:i]) for i, package in enumerate(LAYERS)}


def test_every_package_has_a_layer() -> None:
    packages = {path.name for path in PACKAGE.iterdir()
                if (path / "__init__.py").exists()}
    assert packages == set(LAYERS), sorted(packages ^ set(LAYERS))


def _imported(path: Path) -> set[str]:
    """The hvdlite packages one file imports (hvdlite.X -> X)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                 [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
        found |= {name.split(".")[1] for name in names if name.startswith("hvdlite.")}
    return found


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_no_import_runs_back_up(package: str) -> None:
    wrong = {f"{path.relative_to(PACKAGE.parent)} imports hvdlite.{name}"
             for path in (PACKAGE / package).rglob("*.py")
             for name in _imported(path) & ABOVE[package]}
    assert not wrong, sorted(wrong)
