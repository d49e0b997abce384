"""The docs against the code: what the site generates, and what its pages name.

The strict build (make docs) catches broken links, anchors and API references; these
catch what it cannot: a setting, an alias, an op or an error type with no place in the
docs, a variable the docs name that the code no longer has, a file ARCHITECTURE.md
names that is gone or whose size it misstates.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Optional

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
    forecast = (DOCS / "guide" / "forecast.md").read_text()
    assert "<!-- generated: hvdlite_forecast_help -->" in forecast


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
    forecast_help = HOOKS.hvdlite_forecast_help()
    assert "python -m hvdlite.forecast" in forecast_help and "--paper" in forecast_help


def test_an_unknown_generation_marker_fails_the_build() -> None:
    with pytest.raises(ValueError, match="unknown generation marker"):
        HOOKS.expand("<!-- generated: nothing -->")


def _mentioned(pattern: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in [ROOT / "README.md", *PAGES]:
        for name in re.findall(pattern, path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_the_api_reference_documents_every_runtime_function_hvdlite_exports() -> None:
    """The functions of the runtime and control modules that ``hvdlite`` exports (init(),
    rank(), step_done()...) each have their entry in docs/api."""
    import inspect

    import hvdlite
    reference = "".join(path.read_text() for path in (DOCS / "api").glob("*.md"))
    exported = [f"{value.__module__}.{name}" for name, value in vars(hvdlite).items()
                if inspect.isfunction(value) and not name.startswith("_")
                and value.__module__ in ("hvdlite.api.runtime", "hvdlite.api.control")]
    assert exported and [e for e in exported if f"::: {e}\n" not in reference] == []


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


# The names the maintainers' page and the guides give in backticks, checked against the
# code. A token is checked when it can only mean hvdlite's code:
# - a dotted name from `hvdlite.` (`hvdlite.failure.liveness.Monitor`), imported and looked up;
# - `hvd.NAME`: a name of hvdlite or of one of its bindings;
# - `module.name` whose first part is a module or package the same page names as a file
#   or folder (`liveness.gather` where the page names `liveness.py`), looked up in every
#   hvdlite module of that name, or on a class defined there (`chain.pick`: a chain's);
# - `Class.attr` where every top-level definition of that name in hvdlite is a class;
# - a module path followed by names: "`fusion.py` (`plan_groups`, ...)", "`engine.py`'s
#   `Engine`", "`Engine` in `hvdlite/engine/engine.py`": each name must be in that module.
# Anything else (`torch.distributed`, `model.fit`, a setting, a value) is the reader's code
# or another project's, and is not checked. Fenced blocks run in test_docs_examples.
NAMED_PAGES = [DOCS / "ARCHITECTURE.md", DOCS / "dev" / "testing.md",
               *sorted((DOCS / "guide").glob("*.md"))]
PACKAGE = ROOT / "hvdlite"
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for p in PACKAGE.rglob("*.py"))
BINDINGS = ("hvdlite", "hvdlite.torch", "hvdlite.tensorflow", "hvdlite.keras")
FRAMEWORKS = {binding.rsplit(".", 1)[1] for binding in BINDINGS[1:]}
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
FILE = re.compile(r"\.(py|json|png|txt|pkl|sbatch|conf|yml|so|md)$")    # a file, not a name


class Unknowable(Exception):
    """The name lives in a module whose framework is not installed here."""


def _import(module: str) -> Optional[ModuleType]:
    """The module, None when it does not exist; Unknowable when a dependency is missing."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and (module == error.name
                                       or module.startswith(error.name + ".")):
            return None
        raise Unknowable(module) from error
    except ImportError as error:
        raise Unknowable(module) from error


def _lookup(module: str, attributes: list[str]) -> bool:
    """Whether module.attr1.attr2... exists: an attribute, a submodule not yet imported,
    or an attribute a class's instances get (``self.name = ...``, a dataclass field)."""
    found: object = _import(module)
    if found is None:
        return False
    for index, attribute in enumerate(attributes):
        if hasattr(found, attribute):
            found = getattr(found, attribute)
        elif inspect.ismodule(found):
            return _lookup(f"{found.__name__}.{attribute}", attributes[index + 1:])
        else:
            return (inspect.isclass(found) and index == len(attributes) - 1
                    and _instance_attribute(found, attribute))
    return True


def _instance_attribute(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{name}\s*(?::[^=]*)?=[^=]", source):
            return True
    return False


def _resolves(parts: list[str]) -> bool:
    """hvdlite.a.b.c: the longest importable prefix, then attributes."""
    for split in range(len(parts), 0, -1):
        module = ".".join(parts[:split])
        if _import(module) is not None:
            return _lookup(module, parts[split:])
    return False


def _any_resolves(candidates: list[list[str]]) -> bool:
    """Whether one of several readings resolves; Unknowable only if none does and one
    could not be tried."""
    unknowable = None
    for parts in candidates:
        try:
            if _resolves(parts):
                return True
        except Unknowable as error:
            unknowable = error
    if unknowable is not None:
        raise unknowable
    return False


def _definitions() -> dict[str, list[tuple[str, bool]]]:
    """Every class and function hvdlite defines at a module's top level:
    name -> (module, whether a class)."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for module in MODULES:
        path = ROOT / Path(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                found.setdefault(node.name, []).append(
                    (module, isinstance(node, ast.ClassDef)))
    return found


DEFINITIONS = _definitions()
# A name that is only ever a class (DistributedOptimizer is a class in one binding and a
# function returning one in others: its attributes cannot be looked up by name).
CLASSES = {name: [module for module, _ in where] for name, where in DEFINITIONS.items()
           if all(is_class for _, is_class in where)}
CLASSES_IN = {module: [name for name, where in DEFINITIONS.items()
                       if (module, True) in where] for module in MODULES}


def _modules_for_path(path: str) -> list[str]:
    """The hvdlite modules a backticked path means: hvdlite/engine/x.py one, x.py any."""
    dotted = path.removesuffix(".py").removesuffix("/").replace("/", ".")
    dotted = dotted.removesuffix(".__init__")
    if dotted.startswith("hvdlite"):
        return [dotted] if dotted in MODULES else []
    return [m for m in MODULES if m.endswith("." + dotted)]


def _prose(page: Path) -> str:
    """The page without its fenced blocks and HTML comments."""
    text = re.sub(r"^ *(`{3,}).*?^ *\1 *$", "", page.read_text(), flags=re.S | re.M)
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def _bare(token: str) -> str:
    """`name()` and `name(args)` are the name."""
    return token.split("(", 1)[0] if token.endswith(")") else token


def _readings(token: str, named: set[str]) -> Optional[list[list[str]]]:
    """The ways a dotted token can name hvdlite's code on this page; None: not hvdlite's."""
    parts = token.split(".")
    if parts[0] == "hvdlite":
        return [parts]
    if parts[0] == "hvd":
        return [[*binding.split("."), *parts[1:]] for binding in BINDINGS]
    if parts[0] in FRAMEWORKS:        # `torch.distributed` is torch's, not hvdlite.torch's
        return None
    if parts[0] in named:             # the module's name, or an object of its class
        modules = [(m, k) for m in MODULES for k in range(1, len(parts))
                   if m.endswith("." + ".".join(parts[:k]))]
        return [[*m.split("."), *within, *parts[k:]]
                for m, k in modules for within in [[], *([c] for c in CLASSES_IN[m])]]
    if parts[0] in CLASSES:
        return [[*m.split("."), *parts] for m in CLASSES[parts[0]]]
    return None


def _names_next_to_paths(text: str) -> list[tuple[str, str]]:
    """(path, name) for names a page places in a module by its path."""
    path = r"`(?P<path>(?:hvdlite/)?[\w/]+\.py)`"
    name = r"`(?P<name>[A-Za-z_]\w*)(?:\(\))?`"
    pairs = []
    for match in re.finditer(path + r"(?:'s)? \((?P<inner>[^)]*)\)", text):
        pairs += [(match["path"], inner) for inner in re.findall(
            r"`([A-Za-z_]\w*)(?:\(\))?`", match["inner"])]
    for pattern in (path + "'s " + name, name + " in " + path):
        pairs += [(match["path"], match["name"]) for match in re.finditer(pattern, text)]
    return [(p, n) for p, n in pairs if not n.startswith(("HVDLITE_", "HOROVOD_"))]


def unresolved_names(page: Path) -> list[str]:
    """What the page names in backticks that the code does not have."""
    text = _prose(page)
    tokens = [_bare(t) for t in re.findall(r"`([^`\n]+)`", text)]
    named = {p.removesuffix(".py").rstrip("/").rsplit("/", 1)[-1] for p in tokens
             if re.fullmatch(r"(?:hvdlite/)?[\w/]+(?:\.py|/)", p) and _modules_for_path(p)}
    missing = []
    for token in sorted({t for t in tokens if DOTTED.fullmatch(t) and not FILE.search(t)}):
        readings = _readings(token, named)
        try:
            if readings is not None and not _any_resolves(readings):
                missing.append(f"`{token}`")
        except Unknowable:
            pass
    for path, name in sorted(set(_names_next_to_paths(text))):
        modules = _modules_for_path(path)
        try:
            if modules and not _any_resolves([[*m.split("."), name] for m in modules]):
                missing.append(f"`{name}` in `{path}`")
        except Unknowable:
            pass
    return missing


@pytest.mark.parametrize("page", NAMED_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_name_a_page_gives_exists(page: Path) -> None:
    missing = unresolved_names(page)
    assert not missing, (f"{page.relative_to(ROOT)} names what the code does not have: "
                         f"{', '.join(missing)}")


def test_the_name_check_reports_each_kind_of_absent_name(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "The engine (`hvdlite/engine/engine.py`, `liveness.py`) gathers with "
        "`liveness.gather` and `hvdlite.failure.liveness.no_such`; `hvd.no_such_op()`; "
        "`Engine.no_such_method`; `fusion.py` (`plan_groups`, `no_such_plan`); "
        "`engine.py`'s `NoSuchEngine`; `NoSuchTransport` in `hvdlite/transport/base.py`.\n"
        "Present: `liveness.patient_tick_s`, `hvdlite.failure.liveness.Monitor`, "
        "`hvd.allreduce`, `Engine.submit`, `HostBackend.declined` (set in __init__), "
        "`Transport` in `hvdlite/transport/base.py`. Not hvdlite's: `torch.distributed`, "
        "`model.fit`, `registry.nothing` (this page names no registry.py).\n"
        "```python\nliveness.in_a_block_is_not_prose\n```\n")
    absent = {"`Engine.no_such_method`", "`hvdlite.failure.liveness.no_such`", "`liveness.gather`",
              "`NoSuchEngine` in `engine.py`", "`NoSuchTransport` in `hvdlite/transport/base.py`",
              "`no_such_plan` in `fusion.py`"}
    if all(importlib.util.find_spec(name) for name in FRAMEWORKS):
        absent.add("`hvd.no_such_op`")      # else a binding it could be in is not installed
    assert set(unresolved_names(page)) == absent
