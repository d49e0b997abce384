"""The committed file on every rank: a state rank 0 cannot load (truncated,
corrupted, planted by another user, of the old pickle format) raises the same
StateError on every rank, through hvd.elastic.run, with no rank left waiting in
sync(); the training function never runs. A good file still resumes everywhere. A
commit rank 0 cannot write raises StateWriteError on every rank at that commit."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.elastic import persist
from hvdlite.errors import StateWriteError

# A hang fails the test (and the run) instead of stalling it.
pytestmark = pytest.mark.timeout(60)



def _commit_then(damage: Callable[[Path], None], directory: str) -> None:
    """Commit a state, then let rank 0 ``damage`` its file (the others wait)."""
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=5, log=[1, 2])
    state.commit()
    if hvd.rank() == 0:
        damage(persist.state_path(directory))
    hvd.barrier()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _flip_a_byte(path: Path) -> None:
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0xFF
    path.write_bytes(bytes(content))


def _give_to_nobody(path: Path) -> None:
    os.chown(path, 65534, -1)


def _old_format(path: Path) -> None:
    path.rename(path.with_name(persist.LEGACY_FILE_NAME))


CASES = {"truncated": (_truncate, "truncated"),
         "corrupted": (_flip_a_byte, "cannot read the committed state"),
         "foreign": (_give_to_nobody, "owned by uid 65534"),
         "legacy": (_old_format, "old pickle format")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_state_rank_0_cannot_load_fails_every_rank_alike(elastic_dir: str, case: str) -> None:
    damage, expected = CASES[case]
    if case == "foreign" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    _commit_then(damage, elastic_dir)
    resumed = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0, log=[])
    ran = []

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> None:
        ran.append(state.step)

    with pytest.raises(hvd.StateError) as caught:
        train(resumed)
    messages = hvd.allgather_object(str(caught.value), name=f"epersist.{case}")
    assert len(set(messages)) == 1, messages            # every rank, the same message
    assert expected in messages[0] and elastic_dir in messages[0]
    assert ran == [] and resumed.step == 0
    after = hvd.allreduce(np.ones(1), op=hvd.Sum, name=f"epersist.after.{case}")
    assert after[0] == hvd.size()                       # and the world still works


def test_a_good_state_resumes_on_every_rank(elastic_dir: str) -> None:
    _commit_then(lambda path: None, elastic_dir)
    resumed = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0, log=[])

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> tuple[int, list[int]]:
        return state.step, state.log

    assert train(resumed) == (5, [1, 2])


def test_a_commit_rank_0_cannot_write_fails_every_rank_at_that_commit(
        elastic_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(handle: object, entries: object, commits: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0)
    reached = []

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> None:
        state.step = 1
        state.commit()                                  # on disk
        if hvd.rank() == 0:                             # only rank 0 writes, and finds out
            monkeypatch.setattr(persist, "_write_content", full_disk)
        state.step = 2
        reached.append(2)
        state.commit()                                  # not on disk: every rank raises
        reached.append(3)

    with pytest.raises(StateWriteError) as caught:
        train(state)
    monkeypatch.undo()
    message = str(caught.value)
    assert message.startswith(f"rank {hvd.rank()}: commit 2 did not reach the disk: "), message
    assert f"{persist.state_path(elastic_dir)} (No space left on device)" in message, message
    assert "HVDLITE_ELASTIC_DIR holds commit 1, which a restart resumes" in message, message
    assert reached == [2]                               # stopped at that commit, no retry
    after = hvd.allreduce(np.ones(1), op=hvd.Sum, name="epersist.after.full")
    assert after[0] == hvd.size()                       # no rank was left waiting
    if hvd.rank() == 0:
        assert persist.read(elastic_dir)[1] == 1        # the last good commit stands
    hvd.barrier()
