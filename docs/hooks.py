"""MkDocs hooks: pages generated from the code at build time, so they cannot drift.

- ``<!-- generated: configuration -->`` in a page becomes the table of every setting
  in ``hvdlite/config.py`` (``OPTIONS``): each ``HVDLITE_*`` variable, every Horovod
  name it honours (``Option.aliases``), its type, default and meaning.
- ``<!-- generated: hvdliterun_help -->``, ``hvdlite_jobs_help`` and
  ``hvdlite_forecast_help``: the commands' ``--help``, as they print it.
- ``<!-- generated: ops -->`` becomes the op set every binding generates from its
  adapter (``hvdlite.api.binding.OP_NAMES``), with each signature read from
  ``hvdlite`` itself (the ops are made at import, which static analysis cannot see).

tests/unit/test_docs.py checks the generators against the code.
"""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:        # the tree being documented, not another install
    sys.path.insert(0, str(ROOT))

MARKER = re.compile(r"<!-- generated: (\w+) -->")


# -- the configuration table ----------------------------------------------------------------
def _allowed(parse: Callable[[str], Any]) -> tuple[str, ...] | None:
    """The values a ``config._choice(...)`` parser accepts (its closure holds them)."""
    for cell in parse.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
            return value
    return None


def describe_type(parse: Callable[[str], Any]) -> str:
    """How a setting's value is written, from its parser. A parser not listed here
    fails the build: a new kind of setting must say how it is written."""
    from hvdlite import config
    known = {
        config.parse_bytes: "bytes",
        config.parse_bucket_bytes: "bytes, or `all`",
        config.parse_bool: "boolean",
        config.parse_nonneg_float: "number ≥ 0",
        config.parse_nonneg_int: "integer ≥ 0",
        config.parse_positive_int: "integer ≥ 1",
        config.parse_backends: "list of `device:name` or `name`",
        str: "text",
    }
    if parse in known:
        return known[parse]
    allowed = _allowed(parse)
    if allowed is not None and getattr(parse, "__qualname__", "").startswith("_choice."):
        return "one of " + ", ".join(f"`{value}`" for value in allowed)
    raise ValueError(f"docs/hooks.py cannot describe the parser {parse!r}; add it to "
                     "describe_type")


def describe_default(default: Any, parse: Callable[[str], Any]) -> str:
    from hvdlite import config
    if parse is config.parse_bytes:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if default and default % size == 0:
                return f"`{default // size}{unit}`"
        return f"`{default}`"
    if isinstance(default, bool):
        return "`1`" if default else "`0`"
    if default == "":
        return "(empty)"
    return f"`{default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# Each Agreement of hvdlite.config, as the table's column says it (see "Settings every
# rank must share" in configuration.md).
_ACROSS_RANKS = {"SAME": "[must match](#settings-every-rank-must-share)",
                 "SET": "[set on all or none](#settings-every-rank-must-share)",
                 "OWN": "may differ"}


def configuration_table() -> str:
    """The table of every setting, in config.py's order."""
    from hvdlite.config import OPTIONS
    rows = ["| variable | type | default | across ranks | meaning |", "|---|---|---|---|---|"]
    for option in OPTIONS:
        names = f'<a id="{option.env.lower()}"></a>`{option.env}`'
        if option.aliases:
            names += "<br>or Horovod's " + ", ".join(f"`{a}`" for a in option.aliases)
        if option.deprecated:
            names += "<br>(formerly " + ", ".join(f"`{d}`" for d in option.deprecated) + \
                ", still read, with a warning)"
        rows.append(f"| {names} | {describe_type(option.parse)} | "
                    f"{describe_default(option.default, option.parse)} | "
                    f"{_ACROSS_RANKS[option.agreement.name]} | {_cell(option.doc)} |")
    return "\n".join(rows)


def horovod_names_table() -> str:
    """Horovod's variables hvdlite reads, each with the setting it sets."""
    from hvdlite.config import OPTIONS
    pairs = [(alias, option.env) for option in OPTIONS for alias in option.aliases]
    if not pairs:
        return "hvdlite reads none of Horovod's variables."
    rows = ["| Horovod's variable | is read as |", "|---|---|"]
    rows += [f"| `{alias}` | [`{env}`](#{env.lower()}) |" for alias, env in pairs]
    return "\n".join(rows)


# -- the generated op set ----------------------------------------------------------------------
def _summary(name: str, doc: str | None) -> str:
    """The first paragraph of the op's docstring, or what its name says it is."""
    if doc:
        return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    base = name.rstrip("_")
    if base.endswith("_async"):
        base = base[: -len("_async")]
    if base == name and base.startswith("grouped_"):
        single = base[len("grouped_"):]
        return (f"[`{single}`](#hvdlite.{single}) of every tensor of a list, submitted "
                "together (one negotiation round; tensor i is named `<name>.<i>`); returns "
                "the results as a list.")
    ways = []
    if name.endswith("_async") or name.endswith("_async_"):
        ways.append("returns at once with a handle for `synchronize` and `poll`")
    if name.endswith("_"):
        ways.append("writes the result into the tensor(s) given")
    if not ways:
        raise ValueError(f"the generated op {name} has no docstring; give it one in "
                         "hvdlite/api/binding.py")
    return f"As [`{base}`](#hvdlite.{base}), but " + " and ".join(ways) + "."


def ops_reference() -> str:
    """One entry per generated op: its signature and what it does."""
    import hvdlite
    from hvdlite.api.binding import OP_NAMES
    entries = []
    for name in OP_NAMES:
        function = getattr(hvdlite, name)
        signature = str(inspect.signature(function)).replace("typing.", "")
        signature = re.sub(r"\b(hvdlite\.[\w.]*\.|submission\.)(\w+)", r"\2", signature)
        signature = re.sub(r"\bPS\b", "Optional[ProcessSet]", signature).replace("'", "")
        entries.append(f'### `{name}` {{ #hvdlite.{name} }}\n\n'
                       f"`{name}{signature}`\n\n{_summary(name, function.__doc__)}\n")
    return "\n".join(entries)


# -- command-line help ---------------------------------------------------------------------
def _help(main: Callable[[list[str]], Any]) -> str:
    """What ``main(["--help"])`` prints, at a fixed width, as a text block."""
    import contextlib
    import io
    import os
    out = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "92"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(["--help"])
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return "```text\n" + out.getvalue().rstrip() + "\n```"


def hvdliterun_help() -> str:
    from hvdlite.runner import launch
    return _help(launch.main)


def hvdlite_jobs_help() -> str:
    from hvdlite.runner import jobs
    return _help(jobs.main)


def hvdlite_forecast_help() -> str:
    from hvdlite import forecast
    return _help(forecast.main)


GENERATORS: dict[str, Callable[[], str]] = {
    "hvdliterun_help": hvdliterun_help,
    "hvdlite_jobs_help": hvdlite_jobs_help,
    "hvdlite_forecast_help": hvdlite_forecast_help,
    "configuration": configuration_table,
    "horovod_names": horovod_names_table,
    "ops": ops_reference,
}


def expand(markdown: str) -> str:
    """Replace every generation marker with what it generates (an unknown one fails)."""
    def generated(match: re.Match[str]) -> str:
        kind = match.group(1)
        if kind not in GENERATORS:
            raise ValueError(f"unknown generation marker {match.group(0)!r}; known: "
                             f"{sorted(GENERATORS)}")
        return GENERATORS[kind]()
    return MARKER.sub(generated, markdown)


# -- MkDocs hook ---------------------------------------------------------------------------
def on_page_markdown(markdown: str, **_: Any) -> str:
    return expand(markdown)
