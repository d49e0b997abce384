"""The exceptions hvdlite raises, all rooted at :class:`HvdliteError`.

``HvdliteError`` subclasses ``RuntimeError`` because Horovod's collective errors
are RuntimeErrors, so a script that catches those keeps working. Misuse that
Horovod reports as ``ValueError`` or ``TypeError`` is also one of those here,
through multiple inheritance (:class:`UsageError`, :class:`HvdliteTypeError`).

Errors decided on one rank and raised on every rank travel between ranks as an
:class:`ErrorKind` plus the message text; :func:`error_class` maps the kind
back to the class, so no exception is ever rebuilt from its text.
"""
from __future__ import annotations

import enum


class HvdliteError(RuntimeError):
    """Base class of every error raised by hvdlite."""


class UsageError(HvdliteError, ValueError):
    """A call's arguments cannot be used (a bad root rank, splits, shape...)."""


class HvdliteTypeError(HvdliteError, TypeError):
    """A call was given an object of a type it does not accept."""


class NotSupportedError(UsageError, NotImplementedError):
    """A valid request hvdlite does not implement (an op on sparse gradients that
    only Average and Sum support). Horovod raises NotImplementedError there."""


class NotInitializedError(UsageError):
    """An hvdlite function was called before ``hvdlite.init()``."""

    def __init__(self, what: str = "this function") -> None:
        super().__init__(
            f"hvdlite has not been initialized; call hvdlite.init() before {what}."
        )


class DuplicateNameError(UsageError):
    """A collective was submitted under a name that is already in flight."""


class ConfigError(UsageError):
    """An HVDLITE_* variable or an argument has a value that cannot be used."""


class UnknownBackendError(ConfigError):
    """HVDLITE_BACKENDS (or ``before=``) names a backend that is not registered
    (``hvdlite.backends.register_backend``); ``init()`` raises it on every rank."""

    def __init__(self, name: str, registered: list[str], where: str = "HVDLITE_BACKENDS") -> None:
        super().__init__(f"{where} names backend {name!r}, which is not registered; registered: "
                         f"{', '.join(registered)}. Register it on every rank with "
                         "hvdlite.backends.register_backend(name, factory, devices) before "
                         "hvdlite.init().")
        self.name, self.registered = name, list(registered)


class MismatchError(HvdliteError):
    """Ranks submitted the same tensor name with different parameters, or one
    rank's arguments were invalid (every rank raises this, naming that rank)."""


class BackendRegistryMismatchError(MismatchError):
    """Ranks registered different backends (``hvdlite.backends.register_backend``), or
    the same ones in another order or for other devices: their chains would pick
    different backends for one collective. ``init()`` raises it on every rank, naming
    the ranks and the backends that differ."""

    def __init__(self, message: str, ranks: list[int], backends: list[str]) -> None:
        super().__init__(message)
        self.ranks, self.backends = ranks, backends


class DeadlockError(MismatchError):
    """Every rank waited in hvdlite for a collective that another rank had not
    submitted, with no rank free to submit it (ranks ran different numbers of
    batches, or called different collectives): the job could never continue, so
    every rank's pending collectives fail, naming what each rank waited on."""


class CollectiveFailedError(HvdliteError):
    """A collective could not complete: the engine stopped, a peer was lost or a tensor
    stalled. Horovod's ``HorovodInternalError``: ``hvd.elastic.run`` restores the last
    commit and retries where the world is still whole, else the job ends and
    ``hvdliterun --elastic`` restarts it."""


HorovodInternalError = CollectiveFailedError


class HostsUpdatedError(HvdliteError):
    """The set of hosts changed; ``hvd.elastic.run`` resets without restoring.
    Horovod's ``HostsUpdatedInterrupt`` (same ``skip_sync`` argument)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(f"the set of hosts changed (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


HostsUpdatedInterrupt = HostsUpdatedError


class StateError(UsageError):
    """An elastic State cannot be committed or loaded (an attribute that cannot be
    stored, a committed file that cannot be read or is not private)."""


class StateWriteError(StateError):
    """Writing the committed state to disk failed (a full disk, an I/O error); the
    previous committed file is left as it was. ``State.persist`` (so ``commit()``)
    raises it on every rank, at that commit."""


class HostDiscoveryError(UsageError):
    """``hvdliterun --elastic``: the host discovery script failed, printed a line that
    is not ``host[:slots]``, or reported fewer slots than ``--min-np`` until
    ``--start-timeout``."""


class OutputPathError(ConfigError):
    """An output hvdlite writes (HVDLITE_REPORT, HVDLITE_TIMELINE, HVDLITE_ELASTIC_DIR)
    names a path that cannot be written; raised by ``init()`` on every rank, before
    any training, unless HVDLITE_OUTPUT_CHECK=warn."""


class JoinError(HvdliteError):
    """A collective other than allreduce ran while some rank had joined."""


class StallError(CollectiveFailedError):
    """Some ranks waited on a tensor longer than HVDLITE_STALL_SHUTDOWN_TIME."""


class ShutdownError(CollectiveFailedError):
    """hvdlite was shut down (here or on another rank); collectives cannot complete."""


class PeerLostError(CollectiveFailedError):
    """A peer rank exited or stopped answering; no collective can complete without it."""


class ErrorKind(enum.Enum):
    """What went wrong, as it travels from the coordinator to every rank."""
    MISMATCH = "mismatch"
    JOIN = "join"
    USAGE = "usage"
    PROCESS_SET = "process_set"
    INTERNAL = "internal"


_CLASSES: dict[ErrorKind, type[HvdliteError]] = {
    ErrorKind.MISMATCH: MismatchError,
    ErrorKind.JOIN: JoinError,
    ErrorKind.USAGE: UsageError,
    ErrorKind.PROCESS_SET: HvdliteError,
    ErrorKind.INTERNAL: HvdliteError,
}


def error_class(kind: ErrorKind) -> type[HvdliteError]:
    return _CLASSES[kind]
