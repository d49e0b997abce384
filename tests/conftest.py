"""Every test that runs under an MPI names it in its id, so a failure in `make test`
says which MPI it was (the suites run under MPICH and under Open MPI): whole-job tests
as ``test_x[...-openmpi]``, the ranks of the multi-rank suite as
``test_x[...-openmpi-np2]``, or ``test_x[...-gloo-np2]`` under torchrun. tests/slurm names the MPI in its own parameters (one run
covers both MPIs there); unit tests run no MPI."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def _label(suite: str) -> str | None:
    import os
    from tests.mpi.outcomes import under_torchrun
    if suite == "mpi" and under_torchrun():      # torchrun's ranks: torch.distributed, Gloo
        return f"gloo-np{os.environ['WORLD_SIZE']}"
    from tests.mpirun import mpi_library
    if suite == "integration":
        return mpi_library().flavor
    if suite == "mpi" and "mpi4py.MPI" in sys.modules:   # on the ranks: MPI is running
        return f"{mpi_library().flavor}-np{sys.modules['mpi4py.MPI'].COMM_WORLD.Get_size()}"
    return None


def pytest_report_header(config: pytest.Config) -> str:
    from tests.mpi.outcomes import under_torchrun
    if under_torchrun():
        import torch
        return f"Transport: torch.distributed over Gloo (torch {torch.__version__}), no MPI"
    from tests.mpirun import mpi_library
    return f"MPI: {mpi_library().version} (the library mpi4py loads)"


@pytest.fixture(autouse=True)
def mpi_under_test(request: pytest.FixtureRequest) -> str | None:
    """The MPI's label where pytest_generate_tests gave one (read it if useful)."""
    return getattr(request, "param", None)


@pytest.hookimpl(trylast=True)   # after the tests' own parameters: the label ends the id
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parts = Path(str(metafunc.definition.path)).resolve().relative_to(_HERE).parts
    label = _label(parts[0]) if len(parts) > 1 else None
    if label:
        metafunc.parametrize("mpi_under_test", [label], ids=[label])


# The whole-job tests end jobs by MPI_Abort or a killed rank on purpose, which leaves
# MPICH's and Open MPI's files behind (hvdlite/runner/leftovers.py): each session removes
# what its jobs left. A session inside an MPI rank leaves that to the session that
# launched it.
def _in_an_mpi_rank() -> bool:
    import os
    return any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _in_an_mpi_rank():
        from hvdlite.runner import leftovers
        session.config.stash[_leftovers_key] = leftovers.present()


def pytest_sessionfinish(session: pytest.Session) -> None:
    before = session.config.stash.get(_leftovers_key, None)
    if before is not None:
        from hvdlite.runner import leftovers
        leftovers.sweep(before)


_leftovers_key = pytest.StashKey[set]()
