"""A lane closes when every rank of its set agrees (hvdlite/engine/lane.py): a rank that
freed a lane's owner first stands in for it, beside ranks that still hold the lane and
join, and a rank still summing on a lane another rank closed gets an error naming that
rank. On each transport's own lane channel: MPI's communicator, the node's shared
memory, a Gloo group."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.api.lane import CHECK_WORDS, Lane
from hvdlite.api.submission import synchronize
from hvdlite.errors import UsageError

pytestmark = pytest.mark.timeout(120)


def _open(name: str) -> Lane:
    lane = Lane(name, [3 + CHECK_WORDS], "float32", None)
    if not lane.opened:
        pytest.skip("this transport has no lanes")
    return lane


def _lanes_now() -> set:
    return set(runtime.engine().lanes.counts())


def _until_every_rank(before: set) -> int:
    """Rounds in step on every rank until none holds a lane opened since ``before``
    (each round serves the closed lanes; older lanes may go meanwhile); the rounds
    it took."""
    for rounds in range(1, 2001):
        here = np.array([1 if _lanes_now() <= before else 0], np.int32)
        if hvd.allreduce(here, op=hvd.Min, name="lane_close.until")[0] == 1:
            return rounds
    raise AssertionError(f"rank {hvd.rank()} still holds lanes {_lanes_now() - before}")


def test_a_lane_freed_on_one_rank_while_the_others_join_is_freed_on_every_rank() -> None:
    """Rank 0 frees the lane's owner; the others still hold it and join: their zeros
    meet rank 0's, and once they free it too, every rank frees the channel."""
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    before = _lanes_now()
    owners = [_open("lane_close.joined")]
    if hvd.rank() == 0:
        owners.clear()          # the owner gone here: its finalizer closes the lane
    hvd.join()
    owners.clear()
    _until_every_rank(before)


def test_summing_on_a_lane_another_rank_closed_fails_naming_that_rank() -> None:
    """The last rank frees the owner; the others still sum: a UsageError naming it on
    each of them, not a wait for a rank that will never come."""
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    before = _lanes_now()
    lane = _open("lane_close.stepping")
    last = hvd.size() - 1
    if hvd.rank() == last:
        del lane
    else:
        buf = np.ones(3 + CHECK_WORDS, np.float32)
        with pytest.raises(UsageError) as caught:
            synchronize(lane.submit(buf, 3, 1.0, 4, "the.bucket", ("w",)))
        assert str(caught.value).startswith(
            f"rank {hvd.rank()}: rank {last} closed lane 'lane_close.stepping'"), caught.value
        assert "bucket 'the.bucket' (step 4) was not reduced" in str(caught.value)
        del caught, lane        # (the traceback holds the frame until then)
    gc.collect()
    _until_every_rank(before)
