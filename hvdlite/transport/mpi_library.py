"""Which MPI library this is, and what launching it under SLURM takes. Pure text
handling: the launcher and the renderer ask without initializing MPI
(hvdlite.runner.mpi_impl.library), hvd.init() asks the running library."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Library:
    """The MPI library mpi4py loads."""
    flavor: str      # "openmpi", or "mpich" for MPICH and its derivatives
    version: str     # the first line of MPI_Get_library_version

    @property
    def name(self) -> str:
        if self.flavor == "openmpi":
            return "Open MPI"
        return "MPICH" if "MPICH" in self.version else "an MPICH-derived MPI"

    @property
    def srun_mpi(self) -> str:
        """The plugin that lets ``srun`` start this MPI's ranks as one world: Open MPI 5
        speaks only PMIx; MPICH (the PyPI wheel included), Intel MPI and MVAPICH speak PMI-2."""
        return "pmix" if self.flavor == "openmpi" else "pmi2"


def library_from_version(text: str) -> Library:
    text = text.replace("\x00", "")   # Open MPI's string carries its C terminator
    first = " ".join((text.strip().splitlines() or [""])[0].split())
    # "Open MPI v5.0.11, package: ..., ident: ...": the build details are noise here.
    return Library("openmpi" if "Open MPI" in text else "mpich", first.split(", package:")[0])
