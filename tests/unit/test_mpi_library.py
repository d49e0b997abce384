"""Which MPI library a version string names, without MPI (the launcher's and
hvd.init()'s view of it; the srun plugins are in test_runner.py)."""
from __future__ import annotations

import dataclasses

import pytest

from hvdlite.transport.mpi_library import Library, library_from_version


@pytest.mark.parametrize("text,name", [
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution\x00", "Open MPI"),
    ("MPICH Version:      5.0.2\nMPICH Release date: ...", "MPICH"),
    ("Intel(R) MPI Library 2021.13 for Linux* OS\n", "an MPICH-derived MPI"),
    ("MPICH Version: 3.4 (Cray MPICH 8.1)\n", "MPICH"),
])
def test_the_library_is_named_for_users(text: str, name: str) -> None:
    assert library_from_version(text).name == name


def test_only_the_first_line_counts_and_its_spaces_are_squeezed() -> None:
    library = library_from_version("  \n  MPICH   Version:\t 4.1 \nMPICH Release date: x\n")
    assert library == Library("mpich", "MPICH Version: 4.1")


def test_an_open_mpi_string_keeps_what_precedes_the_package() -> None:
    text = "Open MPI v4.1.6, package: Open MPI x, ident: 4.1.6, repo rev: v4.1.6, Sep 30, 2023"
    assert library_from_version(text) == Library("openmpi", "Open MPI v4.1.6")
    # Open MPI named on a later line only still decides the flavor.
    assert library_from_version("Vendor MPI 1.0\nbased on Open MPI v5").flavor == "openmpi"


@pytest.mark.parametrize("text", ["", "\x00", " \n \n"])
def test_an_empty_version_is_an_unnamed_mpich(text: str) -> None:
    library = library_from_version(text)
    assert library == Library("mpich", "")
    assert (library.name, library.srun_mpi) == ("an MPICH-derived MPI", "pmi2")


def test_a_library_is_an_immutable_value() -> None:
    """Equal by content and hashable (a key for what was asked of it), never changed."""
    first = library_from_version("MPICH Version: 4.1")
    second = Library("mpich", "MPICH Version: 4.1")
    assert first == second and len({first, second}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.flavor = "openmpi"  # type: ignore[misc]
