"""The set-up of the node's shared memory (hvdlite/transport/node_memory.py), with threads as
ranks (the in-process transport): segments that never have a name another process could
take or be left with, and the fall-backs every rank agrees on, which leave nothing held."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from hvdlite.failure.liveness import Peer, identity
from hvdlite.transport import node_memory
from hvdlite.transport.node_memory import NodeMemory, open_node_memory
from tests.unit.fake_transport import ThreadTransport, run_transports

pytestmark = pytest.mark.timeout(120)


def _opened(t: ThreadTransport, **options: Any) -> Optional[NodeMemory]:
    return open_node_memory(t, half_bytes=96, **options)     # a few elements a half


_THIS = threading.local()                   # the rank a thread runs, where a test set it
_RANK_THREADS: dict[int, str] = {}


def _opened_as_rank(t: ThreadTransport) -> Optional[NodeMemory]:
    _THIS.rank = t.rank
    _RANK_THREADS[t.rank] = threading.current_thread().name
    return _opened(t)


def _fail_on_rank(monkeypatch: pytest.MonkeyPatch, rank: int, name: str,
                  applies: Callable[..., bool], error: OSError) -> None:
    """``os.NAME`` raises ``error`` where ``applies`` to its arguments on ``rank``'s
    thread (one run by _opened_as_rank), and works as ever elsewhere."""
    real = getattr(os, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        if getattr(_THIS, "rank", None) == rank and applies(*args):
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, failing)


def segments_held() -> list[str]:
    """This process's descriptors and mappings of node-memory segments (an mmap keeps a
    descriptor of its own), after a collection: a raised error's frames hold theirs."""
    gc.collect()
    held = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):          # a descriptor closed as we looked
            if os.readlink(fd).startswith("/memfd:hvdlite"):
                held.append(f"fd {fd.name}")
    maps = Path("/proc/self/maps").read_text().splitlines()
    return held + [line for line in maps if "/memfd:hvdlite" in line]


def _named_files() -> list[str]:
    """Files with a name that this process shares memory through: mapped shared, or
    open in /dev/shm (a deleted file's path ends in ' (deleted)'; a memfd's is
    '/memfd:NAME (deleted)')."""
    named = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("/dev/shm/") and not target.endswith(" (deleted)"):
                named.append(target)
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[1].endswith("s") and fields[5].startswith("/") \
                and not fields[5].endswith(" (deleted)"):
            named.append(fields[5])
    return named


def test_ranks_on_different_hosts_fall_back_together(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "hvdlite")
    results = run_transports(4, lambda t: _opened(t, host=f"node{t.rank // 2}"))
    assert results == [None] * 4
    assert "more than one host" in caplog.text
    assert segments_held() == []


def test_a_python_without_memfd_create_falls_back_on_every_rank(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delattr(node_memory.os, "memfd_create")
    caplog.set_level(logging.INFO, "hvdlite")
    assert run_transports(3, _opened) == [None] * 3
    assert "no os.memfd_create" in caplog.text


def test_a_segment_one_rank_cannot_make_falls_back_on_every_rank_and_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 2's reservation of its pages fails, as where memory runs out."""
    _fail_on_rank(monkeypatch, 2, "posix_fallocate", lambda *args: True,
                  OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    caplog.set_level(logging.INFO, "hvdlite")
    assert run_transports(3, _opened_as_rank) == [None] * 3
    assert "rank 2 could not reserve its segment" in caplog.text
    assert "No space left on device" in caplog.text
    assert segments_held() == []


def test_a_segment_a_rank_cannot_open_falls_back_on_every_rank_and_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 may not open its peers' segments (as where they are another user's, or
    undumpable): every rank falls back, rank 0 says why, and nothing holds any segment."""
    def a_peers_segment(path: Any, *args: Any) -> bool:
        return str(path).startswith("/proc/")
    _fail_on_rank(monkeypatch, 1, "open", a_peers_segment,
                  PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
    caplog.set_level(logging.INFO, "hvdlite")
    assert run_transports(3, _opened_as_rank) == [None] * 3
    said = [r for r in caplog.records if "not shared memory" in r.getMessage()]
    assert [(r.levelno, r.threadName) for r in said] == [(logging.INFO, _RANK_THREADS[0])]
    assert said[0].getMessage().startswith(
        "hvdlite: host data over threads, not shared memory: rank 1 could not map rank 0's "
        "segment: [Errno 13] Permission denied")
    assert segments_held() == []


def test_a_descriptor_that_is_not_the_peers_segment_falls_back_on_every_rank(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """What a rank finds at a peer's /proc/PID/fd/FD must be the file the peer made
    (a pid reused after the peer's end may hold another file under that number)."""
    handle = node_memory._handle

    def another_file_on_rank_1(fd: int) -> tuple[int, int, int, int]:
        pid, number, device, inode = handle(fd)
        return pid, number, device, inode + (getattr(_THIS, "rank", None) == 1)

    monkeypatch.setattr(node_memory, "_handle", another_file_on_rank_1)
    caplog.set_level(logging.INFO, "hvdlite")
    assert run_transports(3, _opened_as_rank) == [None] * 3
    assert "rank 0 could not map rank 1's segment: [Errno 3] its process has ended" \
        in caplog.text
    assert segments_held() == []


def test_no_segment_has_a_name_at_any_step_of_the_set_up() -> None:
    """What another user could take or a killed rank leave: a segment reachable by a name.
    At every agreed step of the set-up, and once it is done, nothing this process has
    open or mapped is a file with a name (/proc/self/fd, /proc/self/maps) that it did
    not have before (MPI's own segment, say, where a test before this one started MPI)."""
    before = set(_named_files())
    named: list[tuple[int, list[str]]] = []

    class Watched(ThreadTransport):
        def allgather(self, obj: Any) -> list[Any]:
            named.append((self.rank, _named_files()))
            return super().allgather(obj)

        def bcast(self, obj: Any, root: int = 0) -> Any:
            named.append((self.rank, _named_files()))
            return super().bcast(obj, root)

    memories = run_transports(3, _opened, make=Watched)
    assert all(memory is not None for memory in memories)
    named.append((-1, _named_files()))
    assert len(named) >= 3 * 3 + 1          # the facts, the segments made, all mapped
    assert [(rank, sorted(set(files) - before)) for rank, files in named
            if set(files) - before] == []
    assert len(segments_held()) >= 3 * 3     # each rank maps every rank's
    for memory in memories:
        memory.close()
    assert segments_held() == []


def test_ranks_in_other_pid_namespaces_fall_back_together(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Their pids mean nothing to each other, so an exited peer could not be found."""
    def apart(rank: int) -> Peer:
        me = identity(rank)
        return dataclasses.replace(me, domain=(me.host, "boot", f"pid:[{rank}]"))

    monkeypatch.setattr(node_memory, "identity", apart)
    caplog.set_level(logging.INFO, "hvdlite")
    assert run_transports(3, _opened) == [None] * 3
    assert "another pid namespace" in caplog.text
    assert segments_held() == []
