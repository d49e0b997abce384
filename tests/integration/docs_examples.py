"""The code blocks of the README and the docs, and how each is run.

Every fenced block has a language. What happens to it is said by an HTML comment on
the line just before its fence (invisible on the rendered page):

- ``python``: run under ``mpiexec -n 2`` (no comment needed). ``<!-- run: continues -->``
  appends the block to the previous Python block of the same page, which then runs
  as one program (a fragment that needs the objects made above it).
  ``<!-- run: script -->`` runs it as a plain script, ``python block.py``, with no
  launcher (a program that starts its own ranks, as ``hvdlite.run`` does).
- ``bash``: ``<!-- run: shell -->`` runs it with bash, in a scratch directory where
  ``.venv/bin`` is this interpreter's environment and ``examples/``, ``jobs/`` and
  ``hvdlite/`` are the repository's; ``train.py`` and ``script.py`` there are a small
  hvdlite program, so launch lines can run as written; pictures they draw under
  ``docs/images/`` land in the scratch directory.
- ``text``: output or a listing, never run.
- Any block: ``<!-- not-run: why -->`` leaves it out, and the reason is required.

A block of another language, or a ``bash`` block with neither comment, fails the
test: nothing in the docs goes untested without a reason written beside it.

``python -m tests.integration.docs_examples PROGRAMS.json`` is the rank side: it runs
each program in turn in a fresh namespace, compiled under its page's path with the
page's line numbers, so a traceback points at the line of the page.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>run|not-run):\s*(?P<arg>.*?)\s*-->\s*$")
SHELLS = ("bash", "sh", "shell")


def sources() -> list[Path]:
    """The README, every page under docs/, and BENCHMARKS.md (included in the site)."""
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md",
            *sorted((ROOT / "docs").rglob("*.md"))]


@dataclasses.dataclass
class Block:
    path: str               # relative to the repository
    line: int               # of the first line of code (1-based)
    lang: str
    code: str
    marker: Optional[tuple[str, str]]    # ("run" | "not-run", argument)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, dedented to their fence."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    previous = ""                  # the last non-blank line before the current one
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            if lines[index].strip():
                previous = lines[index]
            index += 1
            continue
        indent, fence = len(match["indent"]), match["fence"]
        lang = match["info"].strip().split(" ")[0].lstrip("{.").rstrip("}")
        body: list[str] = []
        index += 1
        start = index + 1
        while index < len(lines) and lines[index].strip() != fence:
            line = lines[index]
            body.append(line[indent:] if not line[:indent].strip() else line.lstrip())
            index += 1
        marker = MARKER.match(previous)
        found.append(Block(str(path.relative_to(ROOT)), start, lang, "\n".join(body) + "\n",
                           (marker["kind"], marker["arg"]) if marker else None))
        previous = ""
        index += 1
    return found


@dataclasses.dataclass
class Program:
    """Python blocks run as one program (a block and the blocks that continue it)."""
    blocks: list[Block]

    @property
    def where(self) -> str:
        return self.blocks[0].where

    def source(self) -> str:
        """The blocks at their own line numbers, blank lines between them."""
        text, line = "", 1
        for block in self.blocks:
            text += "\n" * (block.line - line) + block.code
            line = block.line + block.code.count("\n")
        return text

    def needs(self) -> set[str]:
        code = "".join(b.code for b in self.blocks)
        return {name for name in ("torch", "tensorflow", "keras")
                if re.search(rf"^\s*(import|from) ({name}|hvdlite\.{name})\b", code, re.M)}


@dataclasses.dataclass
class Plan:
    programs: list[Program]
    scripts: list[Block]
    shell: list[Block]
    skipped: list[tuple[Block, str]]
    problems: list[str]


def plan(paths: Optional[list[Path]] = None) -> Plan:
    """Sort every block into what runs, what is skipped (with its reason) and what is
    wrong (no language, no marker where one is needed, an empty reason)."""
    result = Plan([], [], [], [], [])
    for path in paths or sources():
        last: Optional[Program] = None
        for block in blocks(path):
            kind, arg = block.marker or ("", "")
            if kind == "not-run":
                if not arg:
                    result.problems.append(f"{block.where}: not-run needs a reason")
                result.skipped.append((block, arg))
            elif block.lang == "text":
                if kind:
                    result.problems.append(f"{block.where}: a text block is never run")
            elif not block.lang:
                result.problems.append(f"{block.where}: give the block a language "
                                       "(python, bash, or text for output)")
            elif block.lang == "python" and kind in ("", "run"):
                if arg == "continues":
                    if last is None:
                        result.problems.append(f"{block.where}: nothing to continue")
                    else:
                        last.blocks.append(block)
                    continue
                if arg == "script":
                    result.scripts.append(block)
                    continue
                if arg:
                    result.problems.append(f"{block.where}: unknown run argument {arg!r}")
                last = Program([block])
                result.programs.append(last)
            elif block.lang in SHELLS and (kind, arg) == ("run", "shell"):
                result.shell.append(block)
            else:
                result.problems.append(
                    f"{block.where}: a {block.lang} block needs <!-- run: shell --> "
                    "(bash) or <!-- not-run: reason -->")
    return result


def main(programs_file: str) -> None:
    """Run each program on this rank, in order (every rank runs the same list)."""
    import os
    import hvdlite
    for entry in json.loads(Path(programs_file).read_text()):
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        if rank == "0":
            print(f"=== running {entry['where']}", flush=True)
        code = compile(entry["source"], str(ROOT / entry["path"]), "exec")
        exec(code, {"__name__": "__main__"})     # noqa: S102 (the docs' own examples)
        if hvdlite.is_initialized():
            hvdlite.shutdown()
        from mpi4py import MPI            # every rank done with this program's hvdlite
        MPI.COMM_WORLD.Barrier()          # before any starts the next one's init()
        if rank == "0":
            print(f"=== passed {entry['where']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
