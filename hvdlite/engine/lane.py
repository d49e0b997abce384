"""The lane: agreed gradient buckets reduced with no negotiation round.

Once a reducer's layout is agreed, it opens a lane: one negotiated request
(``Kind.OPEN_LANE``) that every rank of its process set runs at the same point, and
that gives the lane a channel of its own (``Transport.lane_channel``: MPI, a duplicated
communicator; torch, segments of the node's shared memory or a Gloo group) and the sizes
of its buckets. From then on the
reducer hands each step's buckets over in index order, and the engine starts each at
once, in place, as one sum on that channel: no round, no fusion plan, no backend
choice, no copy. Sums on a channel match in the order each rank starts them, so the
k-th sum on a lane is bucket k mod B of step k div B on every rank, by construction.

What a round guaranteed, the sum itself now carries. Each bucket ends in check words,
0 or 1 on each rank: the bits of the step and the bucket's index as this rank counts
them. Summed, a word is 0 or the set's size wherever every rank counted alike. Any
other value means ranks summed different steps together (a rank skipped an optimizer
step), and every rank sees it in the same sums: each fails the bucket with a
MismatchError (the reducer then names every rank's step), and it is never handed
back. The lane itself goes on: every rank still sums every bucket of every step.

A rank whose gradient no longer fits its bucket sends the bucket with the next word
set: every rank then fails the bucket (the failing rank's own error names the
parameter). Another word counts the ranks that have joined (``hvd.join()``). A joined rank's
engine takes part in every lane with zeros, as a joined rank does in a negotiated
allreduce, one sum at a time, until every rank has joined: a sum of joined ranks only
is void on every rank, and moves no lane forward.

A lane closes when every rank of its set agrees, never on one rank's schedule: each rank
frees its owner (a reducer, a sharded optimizer) when its garbage collector gets there.
From then on that rank stands in with zeros counted in two more words (ranks closed,
and rank + 1 of the closing rank), one sum at a time. A sum of ranks that closed or
joined is void; the one where every rank closed is the lane's last on every rank, and
each rank frees the channel after it. A rank still summing a bucket that another rank
closed gets a UsageError naming that rank, instead of waiting for it.

A sum waiting longer than HVDLITE_STALL_CHECK_TIME is logged with its bucket, and
past HVDLITE_STALL_SHUTDOWN_TIME (if set) stops the engine with a StallError, as a
negotiated request would: the ranks are not stepping the same optimizers in the same
order.

A lane has one kind of collective (``LaneKind``). The reducer's lanes sum. A sharded
optimizer's lanes reduce-scatter its gradients and allgather its parameters: there every
rank's segment of the buffer ends in check words (each segment that a rank receives,
for a reduce-scatter; each rank's own, for an allgather), so every rank checks the same
summed words as a sum's. A rank that joined has no shard to step: on these lanes a
join fails the collective on every rank.
"""
from __future__ import annotations

import collections
import enum
import logging
from typing import Optional, Sequence

import numpy as np

from hvdlite.errors import HvdliteError, MismatchError, UsageError
from hvdlite.transport.base import LaneChannel, Pending

STEP_BITS, INDEX_BITS = 16, 12
# The step's bits, the index's, then sums: ranks that failed the bucket, rank + 1 and
# slot + 1 of the failing gradient (exact when one rank failed it), ranks joined,
# ranks closed and rank + 1 of the closing one (exact when one rank closed).
CHECK_WORDS = STEP_BITS + INDEX_BITS + 6
_FAILED, _FAILED_RANK, _FAILED_SLOT, _JOINED, _CLOSED, _CLOSED_RANK = range(-6, 0)
LANE_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})   # exact 0..2^24
_log = logging.getLogger("hvdlite")


class LaneKind(enum.IntEnum):
    """What a lane's collectives are; all of one lane's are of its kind."""
    SUM = 0               # every rank's buffer summed, in place
    REDUCE_SCATTER = 1    # summed, each rank keeping its own segment (into ``out``)
    ALLGATHER = 2         # each rank's buffer, to every rank (segments of ``out``)


# The channel's method for each kind: a channel without it opens no lane of that kind.
CHANNEL_METHODS = {LaneKind.SUM: "start_sum", LaneKind.REDUCE_SCATTER: "start_reduce_scatter",
                   LaneKind.ALLGATHER: "start_allgather"}


def check_words(step: int, index: int, rank: int, failed_slot: Optional[int], joined: bool,
                out: np.ndarray, closed: bool = False) -> None:
    """Write a bucket's check words (see the module's docstring) into ``out``. A joined
    or closed rank knows no step: its step and index words are 0, and count for
    nothing."""
    blank = joined or closed
    for bit in range(STEP_BITS):
        out[bit] = 0 if blank else (step >> bit) & 1
    for bit in range(INDEX_BITS):
        out[STEP_BITS + bit] = 0 if blank else (index >> bit) & 1
    failed = failed_slot is not None
    out[_FAILED] = 1 if failed else 0
    out[_FAILED_RANK] = rank + 1 if failed else 0
    out[_FAILED_SLOT] = failed_slot + 1 if failed else 0
    out[_JOINED] = 1 if joined and not closed else 0
    out[_CLOSED] = 1 if closed else 0
    out[_CLOSED_RANK] = rank + 1 if closed else 0


class LaneOp:
    """One bucket's sum: the whole flat buffer (the gradients, their flags, the check
    words), of which the first ``scaled`` elements are multiplied by ``scale`` after."""
    __slots__ = ("handle", "buf", "out", "scaled", "scale", "step", "name", "names",
                 "pending", "started_at", "joined", "closing", "failed_slot", "warned",
                 "position")

    def __init__(self, buf: np.ndarray, scaled: int, scale: float, step: int = 0,
                 name: str = "", names: Sequence[str] = (),
                 failed_slot: Optional[int] = None, joined: bool = False,
                 out: Optional[np.ndarray] = None, closing: bool = False) -> None:
        """``step``: the optimizer's steps so far, as this rank counts them; ``name``:
        the bucket's; ``names``: its gradients' (for errors); ``failed_slot``: the
        one this rank cannot reduce (see the module's docstring); ``out``: where a
        reduce-scatter or an allgather lands (a sum lands in ``buf``); ``joined``,
        ``closing``: zeros standing in for a joined rank, or for a closed lane."""
        self.handle = -1
        self.buf, self.out = buf, out
        self.scaled, self.scale, self.step = scaled, scale, step
        self.name, self.names = name, names
        self.failed_slot, self.joined = failed_slot, joined
        self.closing = closing
        self.pending: Optional[Pending] = None
        self.started_at = 0.0
        self.warned = False
        self.position = 0

    @property
    def result(self) -> np.ndarray:
        return self.buf if self.out is None else self.out

    @property
    def is_stand_in(self) -> bool:
        """Zeros this rank sent for a joined or closed rank: nobody waits on them."""
        return self.joined or self.closing


class Lane:
    """One lane, on the engine's thread (ops arrive through ``queued``)."""

    def __init__(self, name: str, key: tuple[int, int], channel: LaneChannel, rank: int,
                 size: int, counts: Sequence[int], dtype: np.dtype,
                 kind: LaneKind = LaneKind.SUM,
                 segments: Sequence[Sequence[int]] = ()) -> None:
        """``key``: (its process set, lanes opened on that set before it), alike on every
        rank of the set. ``counts``: each bucket's elements (a sum's buffer; the whole
        of a reduce-scatter's input or an allgather's output); ``segments``: each
        bucket's rank by rank (not for sums), check words included."""
        self.name, self.key, self.rank, self.size = name, key, rank, size
        self.set_id = key[0]
        self.channel, self.counts, self.dtype = channel, list(counts), dtype
        self.kind = kind
        self.segments = [tuple(each) for each in segments]
        # Where each rank's segment ends, by bucket: its check words end there.
        self._ends = [np.cumsum(each) for each in self.segments]
        self.queued: collections.deque[LaneOp] = collections.deque()   # user threads append
        self.running: collections.deque[LaneOp] = collections.deque()
        self.started = 0          # sums this rank started that were not void
        self.posted = 0           # collectives started on the channel, void ones too
        self.joined_done = False  # every rank joined: this rank's zeros are done
        self.closed = False       # its owner is gone here: zeros until every rank's is
        self.freed = False        # every rank closed it: the channel is done with

    @property
    def busy(self) -> bool:
        """Whether a user's collective is queued or under way (a closed lane's zeros
        wait, served with each round, for as long as another rank holds the lane)."""
        return bool(self.queued) or (bool(self.running) and not self.closed)

    def start_queued(self, now: float) -> None:
        while self.queued:
            self._start(self.queued.popleft(), now)

    def _start(self, op: LaneOp, now: float) -> None:
        position = op.position = self.started
        index = position % len(self.counts)
        if self.kind is LaneKind.REDUCE_SCATTER:     # every segment the others receive
            words = np.zeros(CHECK_WORDS, self.dtype)
            check_words(op.step, index, self.rank, op.failed_slot, op.joined, words,
                        op.closing)
            for end in self._ends[index]:
                op.buf[end - CHECK_WORDS:end] = words
        else:
            check_words(op.step, index, self.rank, op.failed_slot, op.joined,
                        op.buf[-CHECK_WORDS:], op.closing)
        if self.kind is LaneKind.SUM:
            op.pending = self.channel.start_sum(op.buf)
        elif self.kind is LaneKind.REDUCE_SCATTER:
            op.pending = self.channel.start_reduce_scatter(op.buf, op.out,
                                                           self.segments[index])
        else:
            op.pending = self.channel.start_allgather(op.buf, op.out, self.segments[index])
        op.started_at = now
        self.started += 1
        self.posted += 1
        self.running.append(op)

    def join_in(self, now: float) -> None:
        """This rank has joined: zeros for the next sum, one at a time."""
        if not self.running and not self.joined_done:
            self.stand_in(now)

    def close_in(self, now: float) -> None:
        """This rank's owner is gone: zeros for the next sum, one at a time, until the
        sum where every rank closed."""
        if not self.running and not self.freed:
            self.stand_in(now)

    def stand_in(self, now: float) -> None:
        """Zeros for the next collective, counted as a joined rank's (a closed one's,
        once closed)."""
        index = self.started % len(self.counts)
        whole, out = self.counts[index], None
        if self.kind is not LaneKind.SUM:
            mine = self.segments[index][self.rank]
            send, receive = (whole, mine) if self.kind is LaneKind.REDUCE_SCATTER else (
                mine, whole)
            whole, out = send, np.zeros(receive, self.dtype)
        self._start(LaneOp(np.zeros(whole, self.dtype), 0, 1.0, joined=not self.closed,
                           out=out, closing=self.closed), now)

    def _words(self, op: LaneOp) -> np.ndarray:
        """The check words summed over the ranks (an allgather's, added up here)."""
        if self.kind is not LaneKind.ALLGATHER:
            return op.result[-CHECK_WORDS:]
        ends = self._ends[op.position % len(self.counts)]
        return np.sum([op.out[end - CHECK_WORDS:end] for end in ends], axis=0)

    def finished(self) -> list[tuple[LaneOp, Optional[HvdliteError]]]:
        """The collectives that are complete, in order, each checked (with its error: the
        check words differ between ranks, or a rank failed it) and scaled. Every
        rank sees the same words, so every rank fails the same ones; the lane goes on
        (each rank still starts every bucket of every step, in order). After the sum
        where every rank closed the lane, ``freed``: nothing follows it on any rank."""
        done: list[tuple[LaneOp, Optional[HvdliteError]]] = []
        while self.running and self.running[0].pending.Test():
            op = self.running.popleft()
            words = self._words(op)
            joined, closed = int(words[_JOINED]), int(words[_CLOSED])
            if closed == self.size:
                self.freed = True
                break
            if joined + closed == self.size:   # only stand-ins: void everywhere
                self.started -= 1
                self.joined_done = True
                continue
            if op.is_stand_in:
                continue
            done.append((op, self._verdict(op, words, joined, closed)))
        return done

    def _verdict(self, op: LaneOp, words: np.ndarray, joined: int,
                 closed: int) -> Optional[HvdliteError]:
        if closed:
            return self._closed_elsewhere(op, words, closed)
        tags = words[:STEP_BITS + INDEX_BITS]
        if np.any((tags != 0) & (tags != self.size - joined)):
            what = ("gathered the parameters" if self.kind is LaneKind.ALLGATHER else
                    "reduced the gradients")
            return StepMismatchError(
                f"rank {self.rank}: the ranks {what} of different "
                f"steps together in bucket '{op.name}' (this rank is at step "
                f"{op.step}): a rank skipped an optimizer step, or took one more. "
                "Every rank must step as often as the others; these gradients were "
                "not handed back.")
        if words[_FAILED] != 0:
            return self._failed(op, words)
        if joined and self.kind is not LaneKind.SUM:
            return UsageError(
                f"rank {self.rank}: {joined} rank(s) joined (hvd.join) while the others "
                f"exchanged '{op.name}'; each rank steps its own shard of the optimizer, "
                "so every rank must step every time: join after the last step")
        if op.scale != 1.0:
            view = op.result[:op.scaled]
            np.multiply(view, op.scale, out=view)
        return None

    def _closed_elsewhere(self, op: LaneOp, words: np.ndarray, closed: int) -> HvdliteError:
        who = (f"rank {int(words[_CLOSED_RANK]) - 1}" if closed == 1 else
               f"{closed} ranks")
        return UsageError(
            f"rank {self.rank}: {who} closed lane '{self.name}' (its owner, an optimizer "
            "or an averager, was freed there) while this rank still uses it: bucket "
            f"'{op.name}' (step {op.step}) was not reduced. Free an optimizer on every "
            "rank, or step it on every rank")

    def _failed(self, op: LaneOp, words: np.ndarray) -> HvdliteError:
        one = words[_FAILED] == 1 and op.names
        if one:
            rank, slot = int(words[_FAILED_RANK]) - 1, int(words[_FAILED_SLOT]) - 1
        if self.kind is LaneKind.ALLGATHER:
            what = f"rank {rank}'s {op.names[slot]}" if one else (
                f"{int(words[_FAILED])} ranks' parts")
            return UsageError(
                f"rank {self.rank}: {what} failed, so '{op.name}' was not gathered on "
                "any rank; that rank's own error says why")
        what = (f"on rank {rank}: the gradient of '{op.names[slot]}'" if one else
                f"on {int(words[_FAILED])} ranks: a gradient")
        return UsageError(
            f"rank {self.rank}: {what} no longer fits its bucket '{op.name}', laid out "
            "for the parameters as they were (that rank's own error says how). "
            "Make the optimizer again after changing the model's parameters, on every "
            "rank")

    def stalled(self, now: float, check_s: float, shutdown_s: float) -> Optional[str]:
        """A message once the oldest sum waited past the stall times (None otherwise);
        logged once past ``check_s``, returned past ``shutdown_s`` (if > 0)."""
        op = next((op for op in self.running if not op.is_stand_in), None)
        if op is None or check_s <= 0:
            return None
        waited = now - op.started_at
        if waited < check_s:
            return None
        message = (f"rank {self.rank}: bucket '{op.name}' (step {op.step}, on "
                   f"lane '{self.name}') has waited {waited:.0f} s "
                   "for the other ranks' part. Are all ranks stepping the same optimizers, "
                   "in the same order, as often?")
        if not op.warned:
            op.warned = True
            _log.warning("%s", message)
        return message if 0 < shutdown_s <= waited else None


class StepMismatchError(MismatchError):
    """Ranks summed different steps together on a lane (the reducer then gathers every
    rank's step to name them)."""
