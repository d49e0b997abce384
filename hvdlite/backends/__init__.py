"""How bytes move: backends behind one small protocol (see ``base``).

Importing this package starts nothing: the MPI-based backends import mpi4py
in their own modules, which the engine loads only inside ``hvdlite.init()``.
``register_backend`` adds one, from any module (see ``registry``).
"""
from hvdlite.backends.base import (Backend, Done, HostBackend, Work, even_counts, offsets,
                                   segment_bounds, widened_dtype)
from hvdlite.backends.registry import register_backend, unregister_backend

__all__ = ["Backend", "Done", "HostBackend", "Work", "even_counts", "offsets", "register_backend",
           "segment_bounds", "unregister_backend", "widened_dtype"]
