"""The docs against the code: what the site generates, and what its pages name.

The strict build (make docs) catches broken links, anchors and API references; these
catch what it cannot: a setting, an alias, an op or an error type with no place in the
docs, a variable the docs name that the code no longer has, a file ARCHITECTURE.md
names that is gone or whose size it misstates.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

import hvdlite
from hvdlite import errors
from hvdlite.api.binding import OP_NAMES
from hvdlite.config import OPTIONS, Config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOKS = _hooks()


def test_the_site_runs_the_generators() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^hooks:\s*\n\s*- docs/hooks\.py", config, re.M)
    assert re.search(r"^strict: true", config, re.M)
    # The README says to open site/index.html: over file:// a link to a folder opens a
    # directory listing, so every link must name its .html file.
    assert re.search(r"^use_directory_urls: false", config, re.M)
    page = (DOCS / "configuration.md").read_text()
    assert "<!-- generated: configuration -->" in page
    assert "<!-- generated: ops -->" in (DOCS / "api" / "hvdlite.md").read_text()


def test_the_configuration_table_has_a_row_per_config_field() -> None:
    table = HOOKS.configuration_table()
    rows = [line for line in table.splitlines()[2:] if line.startswith("| ")]
    fields = [field.name for field in dataclasses.fields(Config)]
    assert len(rows) == len(fields) == len(OPTIONS)
    for row, option in zip(rows, OPTIONS):
        assert f"`HVDLITE_{option.field.upper()}`" in row
        assert f'id="hvdlite_{option.field}"' in row          # the anchor guides link to
        assert HOOKS.describe_type(option.parse) in row
        for alias in option.aliases:
            assert f"`{alias}`" in row
    aliases = HOOKS.horovod_names_table()
    for option in OPTIONS:
        for alias in option.aliases:
            assert f"| `{alias}` | [`{option.env}`]" in aliases


def test_every_parser_has_a_description() -> None:
    for option in OPTIONS:
        assert HOOKS.describe_type(option.parse)
    with pytest.raises(ValueError, match="cannot describe"):
        HOOKS.describe_type(lambda text: text)


def test_the_generated_op_set_covers_op_names() -> None:
    reference = HOOKS.ops_reference()
    for name in OP_NAMES:
        assert f"### `{name}` {{ #hvdlite.{name} }}" in reference
        signature = str(inspect.signature(getattr(hvdlite, name)))
        assert signature.split("(", 1)[1].split(":")[0] in reference   # the first parameter


def test_the_commands_help_is_generated() -> None:
    assert "--elastic" in HOOKS.hvdliterun_help() and "-np NP" in HOOKS.hvdliterun_help()
    assert "srun-mpi" in HOOKS.hvdlite_jobs_help()


def test_an_unknown_generation_marker_fails_the_build() -> None:
    with pytest.raises(ValueError, match="unknown generation marker"):
        HOOKS.expand("<!-- generated: nothing -->")


def _mentioned(pattern: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in [ROOT / "README.md", *PAGES]:
        for name in re.findall(pattern, path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_docs_name_exists() -> None:
    known = {option.env for option in OPTIONS} | {
        old for option in OPTIONS for old in option.deprecated}   # still read, with a warning
    unknown = {name: where for name, where in _mentioned(r"\bHVDLITE_[A-Z][A-Z_]*[A-Z]").items()
               if name not in known}
    assert not unknown, f"the docs name settings config.py does not have: {unknown}"


def test_troubleshooting_explains_every_error() -> None:
    page = (DOCS / "guide" / "troubleshooting.md").read_text()
    headings = set(re.findall(r"^### (\w+)$", page, re.M))
    names = {name: value for name, value in vars(errors).items()
             if inspect.isclass(value) and issubclass(value, Exception)
             and value.__module__ == errors.__name__}
    classes = {name for name, value in names.items() if value.__name__ == name}
    assert classes <= headings, f"no section for {sorted(classes - headings)}"
    aliases = set(names) - classes                      # HorovodInternalError...
    assert all(f"`{alias}`" in page for alias in aliases), aliases
    assert {"XlaCompileError", "UnsupportedBackendError"} <= headings


ARCHITECTURE = (DOCS / "ARCHITECTURE.md").read_text()


@pytest.mark.parametrize("path", sorted(set(re.findall(
    r"`((?:hvdlite|tests|jobs|examples|docs)/[\w/.]*\.(?:py|sbatch|md))`", ARCHITECTURE))))
def test_architecture_names_files_that_exist(path: str) -> None:
    assert (ROOT / path).is_file(), f"ARCHITECTURE.md names {path}, which does not exist"


@pytest.mark.parametrize("path, lines", re.findall(
    r"`((?:hvdlite|tests)/[\w/.]+\.py)` is (?:an? )?(\d+)[- ]line", ARCHITECTURE))
def test_architecture_line_counts_are_current(path: str, lines: str) -> None:
    actual = len((ROOT / path).read_text().splitlines())
    assert abs(actual - int(lines)) <= max(5, actual // 10), (
        f"ARCHITECTURE.md says {path} is {lines} lines; it is {actual}")


def test_architecture_names_every_backend() -> None:
    backends = {p.stem for p in (ROOT / "hvdlite" / "backends").glob("*.py")} - {"__init__"}
    missing = [b for b in backends if f"hvdlite/backends/{b}.py" not in ARCHITECTURE]
    assert not missing, f"ARCHITECTURE.md does not place {missing}"
