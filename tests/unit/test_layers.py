"""Imports run one way: bindings (hvdlite.keras, then hvdlite.tensorflow and
hvdlite.torch, then the Keras code they share, hvdlite._keras) -> hvdlite.reducer ->
hvdlite.api -> hvdlite.core -> hvdlite.backends. Read from the source (every import
statement, also those inside functions), so a lazy import that runs back up fails too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hvdlite"
# A package may not import the ones listed after it: they sit above it.
ABOVE = {
    "tensorflow": {"keras"},
    "torch": {"keras", "tensorflow"},
    "_keras": {"keras", "tensorflow", "torch"},
    "reducer": {"keras", "tensorflow", "torch", "_keras"},
    "api": {"reducer", "keras", "tensorflow", "torch", "_keras"},
    "core": {"api", "reducer", "keras", "tensorflow", "torch", "_keras"},
    "backends": {"core", "api", "reducer", "keras", "tensorflow", "torch", "_keras"},
}


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
