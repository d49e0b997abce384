"""The exceptions hvdlite raises, all rooted at :class:`HvdliteError`.

``HvdliteError`` subclasses ``RuntimeError`` because Horovod's collective errors
are RuntimeErrors, so a script that catches those keeps working. Misuse that
Horovod reports as ``ValueError`` (calls before ``init``, duplicate names) is
also a ``ValueError`` here, through multiple inheritance.
"""
from __future__ import annotations


class HvdliteError(RuntimeError):
    """Base class of every error raised by hvdlite."""


class NotInitializedError(HvdliteError, ValueError):
    """An hvdlite function was called before ``hvdlite.init()``."""

    def __init__(self, what: str = "this function") -> None:
        super().__init__(
            f"hvdlite has not been initialized; call hvdlite.init() before {what}."
        )


class DuplicateNameError(HvdliteError, ValueError):
    """A collective was submitted under a name that is already in flight."""


class MismatchError(HvdliteError):
    """Ranks submitted the same tensor name with different parameters."""


class JoinError(HvdliteError):
    """A collective other than allreduce ran while some rank had joined."""


class StallError(HvdliteError):
    """Some ranks waited on a tensor longer than HVDLITE_STALL_SHUTDOWN_TIME."""


class ShutdownError(HvdliteError):
    """hvdlite was shut down (here or on another rank); collectives cannot complete."""


class PeerLostError(HvdliteError):
    """A peer rank exited or stopped answering; no collective can complete without it."""


class ConfigError(HvdliteError, ValueError):
    """An HVDLITE_* variable or an argument has a value that cannot be used."""
