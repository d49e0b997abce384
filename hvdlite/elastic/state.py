"""Horovod's elastic ``State`` and ``ObjectState``, over restart-based recovery.

A commit is kept encoded per attribute (:mod:`hvdlite.elastic.codec`: plain
values as a JSON tree, arrays and tensors as raw bytes, anything else pickled):
the in-memory copy is then a true snapshot (later in-place changes cannot reach
it), it is exactly what goes to disk, and an attribute that cannot be stored
fails at ``commit()`` on the rank that holds it, naming the attribute. Frameworks add *handlers* for
the objects they know (a torch model is saved through its ``state_dict``);
everything else is a plain attribute, synchronised with ``broadcast_object``.
"""
from __future__ import annotations

import logging
import queue
from typing import Any, Callable, Iterable, Optional

from hvdlite.elastic import codec, ledger, persist, preemption
from hvdlite.elastic.codec import Encoded
from hvdlite.errors import HostsUpdatedError, StateError, StateWriteError

_log = logging.getLogger("hvdlite")


class Handler:
    """How one attribute is captured (to a storable value), applied back and
    synchronised from rank 0. The default treats it as a plain Python object."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def capture(self) -> Any:
        return self.value

    def apply(self, captured: Any) -> Any:
        """Make the attribute equal ``captured``; returns the attribute's new value."""
        self.value = captured
        return captured

    def sync(self, broadcast_object: Callable[[Any], Any]) -> Any:
        """Take rank 0's value; returns the attribute's new value."""
        return self.apply(broadcast_object(self.capture()))


class State:
    """Base class: a training state that survives failures and restarts.

    Subclasses say how to ``save()``, ``restore()`` and ``sync()``; ``commit()``
    saves, writes every ``HVDLITE_ELASTIC_PERSIST_EVERY``-th commit to
    ``HVDLITE_ELASTIC_DIR`` (rank 0; a write that fails raises StateWriteError on
    every rank), and checks for host updates and preemption at the same step
    boundary on every rank.
    """

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: "queue.Queue[tuple[int, Any]]" = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: list[Callable[[], None]] = []
        self._commits = 0
        self._persisted = 0

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Callbacks run after a reset (e.g. to rescale the learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: Any = None) -> None:
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state in memory (and on disk, see the class doc), then check for
        host updates and preemption. Collective: every rank calls it at the same step."""
        self.save()
        self._commits += 1
        ledger.LEDGER.commits += 1
        every = _setting("elastic_persist_every", 1)
        if self._commits % every == 0:
            self.persist()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedError if any rank heard of a host change, or leave through
        :class:`preemption.Preempted` (after writing the last commit) if any rank was
        asked to stop. Collective: one small allreduce."""
        newest = self._last_updated_timestamp
        while not self._host_messages.empty():
            timestamp, _ = self._host_messages.get()
            newest = max(newest, timestamp)
        stop, newest = preemption.agree(newest)
        if stop:
            self.persist()
            raise preemption.Preempted()
        if newest > self._last_updated_timestamp:
            self._last_updated_timestamp = newest
            raise HostsUpdatedError(False)

    def persist(self) -> None:
        """Write the last commit to HVDLITE_ELASTIC_DIR (rank 0; nothing without one).
        Collective when it writes: every rank learns whether the write reached the disk,
        and one that did not raises StateWriteError on every rank, at this commit. The
        user asked for persistence: a job must not train on (and end with status 0)
        with less on disk than it believes, where a crash would lose it all."""
        directory = _setting("elastic_dir", "")
        if not directory or self._persisted == self._commits:
            return
        failure, cause = None, None
        if self._rank() == 0:
            try:
                persist.write(directory, self.committed_entries(), self._commits)
            except Exception as exc:    # any failure: every rank must hear of it
                cause = exc
                failure = str(exc) if isinstance(exc, StateWriteError) else (
                    f"rank 0 could not write the committed state in {directory} "
                    f"({type(exc).__name__}: {exc})")
        failure = self._bcast_object(failure)
        if failure is not None:
            ledger.LEDGER.failed += 1
            raise StateWriteError(self._not_written(failure)) from cause
        self._persisted = self._commits
        ledger.LEDGER.written += 1
        ledger.LEDGER.on_disk = self._commits

    def _not_written(self, failure: str) -> str:
        held = ("no commit, so a restart starts from scratch" if not self._persisted
                else f"commit {self._persisted}, which a restart resumes from")
        return (f"rank {self._rank()}: commit {self._commits} did not reach the disk: "
                f"{failure}. HVDLITE_ELASTIC_DIR holds {held}. hvdlite raises this on every "
                "rank rather than train on without the persistence you asked for; fix the "
                "directory (space, permissions) and run the job again, or unset "
                "HVDLITE_ELASTIC_DIR to keep commits in memory only")

    def load_persisted(self) -> bool:
        """Restore the state committed in HVDLITE_ELASTIC_DIR on rank 0, if any (call
        ``sync()`` after, on every rank). Collective when a directory is set: a file
        rank 0 cannot load raises the same StateError on every rank, rather than
        leaving the others waiting in ``sync()``. Returns whether this rank loaded one
        (rank 0 only)."""
        directory = _setting("elastic_dir", "")
        if not directory:
            return False
        found, failure = False, None
        if self._rank() == 0:
            try:
                found = self._load_from(directory)
            except Exception as exc:    # any failure: every rank must hear of it
                failure = exc
        message = self._bcast_object(None if failure is None else _describe(failure))
        if message is not None:
            raise StateError(message) from failure
        return found

    def _load_from(self, directory: str) -> bool:
        found = persist.read(directory, trust=_setting("elastic_trust_dir", False))
        if found is None:
            return False
        entries, commits = found
        self.load_entries(entries)
        try:
            self.restore()
        except codec.Malformed as exc:
            raise persist.unreadable(persist.state_path(directory), str(exc)) from exc
        self._commits = self._persisted = commits
        ledger.LEDGER.on_disk = commits
        _log.info("resuming from commit %d in %s", commits, directory)
        return True

    def committed_entries(self) -> dict[str, Encoded]:
        """The last commit, encoded per attribute."""
        raise NotImplementedError()

    def load_entries(self, entries: dict[str, Encoded]) -> None:
        """Make ``entries`` the last commit (``restore()`` then applies it)."""
        raise NotImplementedError()

    def save(self) -> None:
        """Save the state in host memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Return to the last commit, undoing later changes."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Make every rank's state equal rank 0's."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Adapt to a new world after a reset, before the next sync."""


class ObjectState(State):
    """State of Python objects given as keyword arguments, exposed as attributes.
    Subclasses pass ``handlers`` for attributes that need more than pickling."""

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int],
                 handlers: Optional[dict[str, Handler]] = None, **kwargs: Any) -> None:
        handlers = dict(handlers or {})
        for name, value in kwargs.items():
            handlers[name] = Handler(value)
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)
        # Nothing is encoded yet: hvd.elastic.run's first sync() saves, and an
        # attribute that cannot be stored is reported by commit(), by name.
        self._saved: dict[str, Encoded] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value     # state.epoch = 3 is what the next commit saves
        object.__setattr__(self, name, value)

    def save(self) -> None:
        saved = {}
        for name, handler in self._handlers.items():
            handler.value = getattr(self, name)
            saved[name] = codec.encode(handler.capture(), name)
        self._saved = saved

    def restore(self) -> None:
        for name, encoded in self._saved.items():
            object.__setattr__(self, name, self._handlers[name].apply(codec.decode(encoded)))

    def sync(self) -> None:
        for name, handler in self._handlers.items():
            handler.value = getattr(self, name)
            object.__setattr__(self, name, handler.sync(self._bcast_object))
        # Every rank's last commit is now rank 0's, so a restore() after a failure
        # returns every rank to the same point.
        self.save()

    def committed_entries(self) -> dict[str, Encoded]:
        return dict(self._saved)

    def load_entries(self, entries: dict[str, Encoded]) -> None:
        unknown = sorted(set(entries) - set(self._handlers))
        missing = sorted(set(self._handlers) - set(entries))
        if unknown or missing:
            raise StateError(f"the committed state holds attributes {sorted(entries)}, this "
                             f"State has {sorted(self._handlers)} (unknown: {unknown}, "
                             f"missing: {missing}); use a new HVDLITE_ELASTIC_DIR to start over")
        self._saved = dict(entries)


def _describe(failure: BaseException) -> str:
    """The text every rank raises for rank 0's failure to load the committed state."""
    if isinstance(failure, StateError):
        return str(failure)
    return (f"rank 0 could not restore the committed state in HVDLITE_ELASTIC_DIR "
            f"({type(failure).__name__}: {failure}); if it belongs to another model or "
            "run, use a new HVDLITE_ELASTIC_DIR to start over")


def _setting(field: str, default: Any) -> Any:
    from hvdlite.api import runtime
    engine = runtime.RUNTIME.engine
    current = engine.config if engine is not None else runtime.RUNTIME.config
    return getattr(current, field) if current is not None else default
