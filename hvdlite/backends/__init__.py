"""How bytes move: backends behind one small protocol (see ``base``).

Importing this package starts nothing: the MPI-based backends import mpi4py
in their own modules, which the engine loads only inside ``hvdlite.init()``.
"""
from hvdlite.backends.base import (Backend, Done, HostBackend, Work, even_counts, offsets,
                                   segment_bounds, widened_dtype)

__all__ = ["Backend", "Done", "HostBackend", "Work", "even_counts", "offsets", "segment_bounds",
           "widened_dtype"]
