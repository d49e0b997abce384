"""hvdliterun's inputs, checked before any of them reaches the launcher: host lists (-H,
--hostfile, a discovery script's lines), slot and rank counts, seconds, and the program
the ranks are to run.

The launchers trust what they are given, and some inputs hang them: MPICH's mpiexec
given ``localhost:99999999999999999999`` spins for ever without starting a rank (and
ignores SIGTERM), and a host name that begins with '-' reaches ssh as an option. Each
check raises ConfigError saying what is wrong; the caller names the input and the fix.
"""
from __future__ import annotations

import math
import os
import re
import shutil
from typing import Optional, Sequence

from hvdlite.errors import ConfigError

# Slots on one host: above the hardware threads of the largest machines (a few thousand),
# far below where a launcher's C int would overflow. A count above it is a typo.
MAX_SLOTS = 4096
# Ranks in one job (-np, --min-np): beyond the largest MPI jobs run on one launcher.
MAX_RANKS = 1 << 20
# A host name or an IPv4 address: letters, digits, '.', '-' and '_' (not RFC 1123's, but
# cluster node names have it), never beginning with '-' (ssh would read an option).
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_MAX_HOST = 253                  # the longest DNS name
_DIGITS = re.compile(r"[0-9]+")  # str.isdigit() also takes '²', which int() refuses
# Hostfile options that count slots: Open MPI's (`node slots=4 max_slots=8`).
_SLOT_OPTIONS = ("slots", "max_slots", "max-slots", "count")
# A Python interpreter's name: python, python3, python3.12.
_PYTHON = re.compile(r"python[0-9.]*")


def shown(text: str, limit: int = 60) -> str:
    """``text`` quoted for a message, cut short: an input may be a whole file's line."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def host_problem(host: str) -> Optional[str]:
    """What makes ``host`` unusable as a host name, or None."""
    if not host:
        return "the host name is empty"
    if host.startswith("-"):
        return (f"host name {shown(host)} begins with '-', which ssh would take for an "
                "option")
    if len(host) > _MAX_HOST:
        return f"host name {shown(host)} is longer than {_MAX_HOST} characters"
    if not _HOST.fullmatch(host):
        return (f"host name {shown(host)} has characters other than letters, digits, "
                "'.', '-' and '_'")
    return None


def parse_slots(text: str) -> int:
    """A slot count: a whole number from 1 to MAX_SLOTS, else ConfigError."""
    if not _DIGITS.fullmatch(text):
        raise ConfigError(f"slots {shown(text)} is not a whole number")
    # Checked by length first: int() of thousands of digits is slow, then refused.
    if len(text.lstrip("0")) > len(str(MAX_SLOTS)) or not 1 <= int(text) <= MAX_SLOTS:
        raise ConfigError(f"slots {shown(text)} is not between 1 and {MAX_SLOTS}")
    return int(text)


def parse_entry(entry: str) -> tuple[str, int]:
    """``host`` or ``host:slots`` -> (host, slots), else ConfigError."""
    host, colon, slots = entry.partition(":")
    problem = host_problem(host)
    if problem:
        raise ConfigError(problem)
    return host, (parse_slots(slots) if colon else 1)


def parse_host_list(value: str) -> list[tuple[str, int]]:
    """-H's ``host:slots,host:slots`` -> [(host, slots)], else ConfigError naming -H."""
    try:
        return [parse_entry(entry) for entry in value.split(",")]
    except ConfigError as exc:
        raise ConfigError(f"-H {shown(value)}: {exc}; give host[:slots],... with slots from "
                          f"1 to {MAX_SLOTS}, e.g. -H node1:4,node2:4") from None


def check_hostfile(path: str) -> None:
    """A hostfile in MPICH's format (``node1:4``) or Open MPI's (``node1 slots=4``), '#'
    comments: every host name and slot count is checked, else ConfigError naming the
    file and the line."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--hostfile {path} cannot be read ({exc}); give a text file "
                          "with one host per line") from None
    hosts = 0
    for number, raw in enumerate(lines, start=1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        try:
            _check_hostfile_line(words)
        except ConfigError as exc:
            raise ConfigError(f"--hostfile {path} line {number} {shown(raw.strip())}: {exc}; "
                              f"fix the line (host names, slots from 1 to {MAX_SLOTS})") from None
        hosts += 1
    if not hosts:
        raise ConfigError(f"--hostfile {path} names no host; give one host per line")


def _check_hostfile_line(words: list[str]) -> None:
    user, at, entry = words[0].rpartition("@")     # Open MPI takes user@host
    if at and host_problem(user):
        raise ConfigError(f"user name {shown(user)} is not a plain name (it may not begin "
                          "with '-')")
    parse_entry(entry)
    for option in words[1:]:
        key, equals, value = option.partition("=")
        if equals and key in _SLOT_OPTIONS:
            parse_slots(value)


def check_ranks(flag: str, count: int) -> None:
    """A number of ranks from 1 to MAX_RANKS, else ConfigError naming ``flag``."""
    if not 1 <= count <= MAX_RANKS:
        raise ConfigError(f"{flag} {count} is not between 1 and {MAX_RANKS}; give the "
                          "number of ranks to start")


def check_number(flag: str, value: float, unit: str, zero: bool = True) -> None:
    """A finite number >= 0 (> 0 unless ``zero``), else ConfigError naming ``flag``: nan
    compares false with everything, so a deadline nan seconds away never comes."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        least = ">= 0" if zero else "> 0"
        raise ConfigError(f"{flag} {value:g} is not a finite number of {unit} {least}; "
                          f"give {flag} such a number")


def program_problem(command: Sequence[str]) -> Optional[str]:
    """Why a rank on this machine could not start ``command``, or None: the program
    resolved as the rank's exec would (a path as given, a bare name on PATH), and the
    script of ``python SCRIPT ...`` (a missing one fails in every rank, each saying so)."""
    program = command[0]
    if os.sep in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            return (f"the program {program} is not an executable file; give the path of "
                    "one, or a program on PATH")
    elif shutil.which(program) is None:
        return (f"the program {shown(program)} is not on PATH; give its path, or install "
                "it where the ranks find it")
    script = python_script(command)
    if script is not None and not os.path.isfile(script):
        return (f"{program}'s script {script} does not exist (in {os.getcwd()}); give the "
                "path of the training script")
    return None


def python_script(command: Sequence[str]) -> Optional[str]:
    """The script that ``command`` runs when it is ``python [OPTIONS] SCRIPT ...``; None
    for another program, ``-m``, ``-c``, stdin, or options not understood here."""
    if not _PYTHON.fullmatch(os.path.basename(command[0])):
        return None
    arguments = iter(command[1:])
    for argument in arguments:
        if argument in ("-W", "-X"):           # options that take the next word
            next(arguments, None)
        elif argument == "--":
            return next(arguments, None)
        elif argument.startswith(("-W", "-X")):
            continue
        elif argument.startswith("--") or argument == "-":
            return None                        # --version, stdin: no script to check
        elif argument.startswith("-"):
            if "c" in argument or "m" in argument:
                return None                    # -c CODE, -m MODULE (alone or with flags)
        else:
            return argument
    return None
