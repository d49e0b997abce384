"""The reducer: gradients in flat buckets, each bucket reduced in place by one request.

The buckets are laid out from the parameters' specs (``layout``), agreed by one
exchange that also checks every rank trains the same parameters, and made once,
through the framework's adapter, on the parameters' devices. A binding then tells
the reducer two things:

- torch (hooks): a parameter's gradient is in its view of the bucket (``ready``),
  counting backward passes (``backward_passes_per_step``); a bucket whose last
  gradient is ready starts at once, while backward goes on; ``start_the_rest`` and
  ``wait`` at ``synchronize()``;
- TensorFlow and Keras (lists): ``reduce(gradients)`` packs them into the buckets,
  reduces, and unpacks them.

Buckets of float32 or float64 on the CPU go on a lane (``hvdlite.api.lane``,
HVDLITE_LANE): opened once per layout, right after it is agreed; each step then hands
each bucket over whole, in index order, with no negotiation, and the lane sums it in
place with its check words (the optimizer's step among them) and scales it once.
The others are negotiated: each bucket's request is prepared once
(``hvdlite.api.prepared``) and agreed by the engine's response cache with one bit, so
a step costs one submission per bucket; with compression, a compressed copy of the
bucket travels instead. A gradient reduced elsewhere (a sparse one, by allgather) is
evicted from its bucket, which is then reduced (negotiated) in the pieces around it.

Which gradients exist travels with them: each bucket ends in one flag per
gradient, 1 where this rank has the gradient and 0 where it has none (a
parameter its loss did not reach), reduced with the data. A flag that comes back
0 says no rank had that gradient: the binding leaves it missing (torch: ``.grad``
stays None), so the optimizer skips the parameter as it would in one process,
where a zero would move it (momentum, Adam). A flag that comes back nonzero says
some rank had it: the average counts this rank's missing gradient as zeros.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NoReturn, Optional, Sequence

from hvdlite.api import collectives, lane, objects, runtime, submission
from hvdlite.api.adapter import TensorAdapter
from hvdlite.api.compression import Compression
from hvdlite.api.prepared import PreparedAllreduce
from hvdlite.api.variable_check import agree_variables
from hvdlite.errors import HvdliteError, MismatchError, UsageError
from hvdlite.negotiation.requests import Kind, to_dtype
from hvdlite.reduce_op import ReduceOp
from hvdlite.reducer import layout
from hvdlite.reducer.bucket import Bucket, Spec
from hvdlite.reducer.settings import Settings

_FAILED = object()       # a piece's handle after this rank failed it (see Reducer.fail)


class Reducer:
    """Every bucket of one optimizer (or one list of variables), and each step's state."""

    def __init__(self, adapter: TensorAdapter, specs: Sequence[Spec], settings: Settings,
                 position_of: Callable[[Any], Optional[int]] = lambda member: member,
                 trainable: Optional[Sequence[bool]] = None,
                 present: Optional[Sequence[bool]] = None) -> None:
        """``specs``: one per parameter, in registration order; ``position_of``: the
        position of a ``groups=`` member (a parameter), None for one not here;
        ``trainable``: which parameters are reduced (default: all). The others get no
        bucket, but the ranks agree on them too: a parameter trainable on some ranks
        only is a MismatchError on every rank, naming it. ``present``: which have a
        gradient on this rank in every call (a traced graph's are fixed when traced);
        one that no rank has gets no bucket either, and is listed in ``never``."""
        self.settings, self._adapter = settings, adapter
        self.names = [spec[0] for spec in specs]
        self._dtypes = [spec[2] for spec in specs]
        self.alone = settings.alone()
        if not self.alone:
            # Named by the optimizer alone: the variables' names may differ between ranks
            # (Keras numbers a model's layers per process: a model loaded on rank 0 has
            # dense_2 where a fresh one has dense). The exchange blocks the calling thread,
            # so two optimizers' exchanges never overlap under the same name.
            compared = [spec[:3] if trainable is None else (*spec[:3], trainable[i])
                        for i, spec in enumerate(specs)]
            agreed, anywhere = agree_variables(compared, settings.what, settings.process_set,
                                               f"{settings.what}.layout", present)
            # Requests are named by the set's first rank's names, alike on every rank.
            specs = [(name, *spec[1:]) for name, spec in zip(agreed, specs)]
        else:
            anywhere = [True] * len(specs) if present is None else list(present)
        self.never = {i for i in range(len(specs)) if not anywhere[i]}
        reduced = [i for i in range(len(specs)) if (trainable is None or trainable[i])
                   and i not in self.never]
        nbytes = [math.prod(shape) * to_dtype(dtype).itemsize for _, shape, dtype, _ in specs]
        groups = layout.group_positions(len(specs), settings.groups, position_of, reduced)
        plan = layout.plan(nbytes, [spec[2:] for spec in specs], runtime.config().bucket_bytes,
                           groups, reduced)
        buffers = None if self.alone else adapter.buffers
        kinds = {tuple(specs[members[0]][2:]) for members in plan}
        on_lane = (not self.alone and len(kinds) == 1 and lane.carries(*next(iter(kinds)))
                   and settings.compression is Compression.none)
        words = lane.CHECK_WORDS if on_lane else 0
        self.buckets = [Bucket(i, members, specs, settings.what, buffers, words)
                        for i, members in enumerate(plan)]
        self._lane: Optional[lane.Lane] = None
        self._lane_next = 0          # the next bucket to hand to the lane this step
        # Optimizer steps taken, as this rank counts them: a lane's check words carry it
        # (a rank that skipped one is a MismatchError). The binding that steps keeps it.
        self.steps = 0
        if on_lane:
            self._open_lane(next(iter(kinds))[0])
        self.slot_of = {position: (bucket, slot) for bucket in self.buckets
                        for slot, position in enumerate(bucket.members)}
        self._passes = [0] * len(specs)
        self._started: list[Bucket] = []
        # The positions no rank had a gradient for, in the step last waited for.
        self.unused: set[int] = set()
        if not self.alone:
            # The exchange may have made the engine's host fusion buffer; buckets never
            # pack into it, and resident it put the bucketed transformer's peak memory
            # 1-2% above DDP's (BENCHMARKS.md). Whatever packs later makes a new one.
            runtime.release_host_fusion_buffer()

    def _open_lane(self, dtype: str) -> None:
        """A lane for the buckets (hvdlite/engine/lane.py): opened on every rank of the
        set, as the layout was agreed; the buckets' arrays and scale fixed from now on."""
        # Named as the layout's exchange, which it completes, and by the parameters.
        first, last = self.buckets[0].names[0], self.buckets[-1].names[-1]
        opened = lane.Lane(f"{self.settings.what}.layout.lane.{first}..{last}",
                           [bucket.size for bucket in self.buckets], dtype,
                           self.settings.process_set)
        if not opened.opened:
            return
        op, prescale, postscale = self.settings.scaled_op()
        scale = prescale * postscale
        if op == ReduceOp.AVERAGE:
            scale /= self.settings.set_size()
        to_array = self._adapter.buffers.to_array
        self._lane = opened
        self._lane_arrays = [to_array(bucket.flat) for bucket in self.buckets]
        self._lane_scale = scale

    def _to_lane(self) -> None:
        """Hand the started buckets to the lane in index order, as far as they go: the
        k-th sum on a lane is bucket k of the step on every rank."""
        buckets, arrays, scale = self.buckets, self._lane_arrays, self._lane_scale
        while self._lane_next < len(buckets) and buckets[self._lane_next].inflight is not None:
            bucket = buckets[self._lane_next]
            self._lane_next += 1
            handle = self._lane.submit(arrays[bucket.index], bucket.total, scale,
                                       self.steps, bucket.name, bucket.names,
                                       bucket.failed_slot)
            bucket.inflight.append((handle, bucket.flat, bucket.flat, None))

    # -- a framework that hands gradients over one by one (torch's hooks) ----------------------
    def holds(self, position: int) -> bool:
        """Whether the parameter has a bucket (it is trainable)."""
        return position in self.slot_of

    def view(self, position: int) -> Any:
        """The parameter's gradient in its bucket (None on a set of one rank)."""
        bucket, slot = self.slot_of[position]
        return bucket.views[slot]

    def evict(self, position: int) -> None:
        """This gradient is reduced elsewhere from now on (a sparse one): its bucket
        is reduced without it. Every rank must evict it at the same step."""
        bucket, slot = self.slot_of[position]
        bucket.evict(slot)

    def ready(self, position: int) -> bool:
        """Count a backward pass of ``position``; True once it has them all this step.
        A bucket whose last gradient is complete starts at once."""
        bucket, _ = self.slot_of[position]
        passes = self._passes[position] + 1
        if passes > self.settings.passes or bucket.inflight is not None:
            raise HvdliteError(
                f"rank {runtime.rank()}: the gradient of '{self.names[position]}' was "
                f"computed more than backward_passes_per_step={self.settings.passes} times "
                "before step(). Raise backward_passes_per_step to accumulate gradients "
                "locally, or call step() (or synchronize()) after each backward().")
        self._passes[position] = passes
        if passes < self.settings.passes:
            return False
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._start(bucket)
        return True

    def unready(self) -> list[int]:
        """The positions whose bucket has not started (synchronize() hands them over as
        they are: a missing gradient takes part as zeros, so every rank reduces every
        bucket)."""
        return [position for bucket in self.buckets if bucket.inflight is None
                for position in bucket.members if self._passes[position] < self.settings.passes]

    def absent(self, position: int) -> None:
        """This rank has no gradient for ``position`` this step: it takes part as zeros,
        and ``unused`` tells after ``wait`` whether any rank had one."""
        bucket, slot = self.slot_of[position]
        if bucket.views[slot] is not None:
            bucket.views[slot][...] = 0
        bucket.absent.append(slot)

    def start_the_rest(self) -> None:
        for bucket in self.buckets:
            if bucket.inflight is None:
                self._start(bucket)

    def fail(self, position: int, shape: tuple[int, ...], dtype: str) -> NoReturn:
        """A gradient no longer fits the layout (its parameter changed): fail this rank,
        and its bucket on every rank through negotiation (an error marker under each
        of its requests' names), instead of a hang or a sum of mismatched memory."""
        bucket, slot = self.slot_of[position]
        error = UsageError(
            f"rank {runtime.rank()}: the gradient of '{self.names[position]}' is "
            f"{tuple(shape)} {dtype}, but its bucket was laid out for "
            f"{tuple(bucket.shapes[slot])} {self._dtypes[position]}. Make the "
            "DistributedOptimizer after changing the model's parameters (on every rank)")
        if self._lane is not None and not bucket.evicted:    # every rank fails it on the lane
            bucket.failed_slot = slot
            if bucket.inflight is None:
                self._start(bucket)
            raise error
        for name, _, _ in bucket.pieces():
            submission.Call(Kind.ALLREDUCE, name, self.settings.process_set).mark(error)
        bucket.inflight = [(_FAILED, None, None, None)]
        self._started.append(bucket)
        raise error

    @property
    def pending(self) -> int:
        """Gradients in buckets started and not waited for."""
        return sum(len(b.members) - len(b.evicted) for b in self._started)

    def zero(self) -> None:
        """zero_grad(set_to_none=False): every bucket's gradients are zeros."""
        for bucket in self.buckets:
            if bucket.flat is not None:
                bucket.flat[...] = 0

    # -- a framework that hands every gradient over at once (TensorFlow, Keras) ---------------
    def reduce(self, tensors: Sequence[Any], absent: Sequence[int] = ()) -> list[Any]:
        """The tensors (one per spec, in order) averaged across ranks: packed into the
        buckets (one copy), reduced in place, unpacked (TensorFlow: one copy; torch:
        views of the buckets, valid until the next call). ``absent``: the positions
        this rank has no gradient for (their tensors are zeros); ``unused`` then says
        which no rank had."""
        reduced = list(tensors)
        if absent:
            missing = set(absent)
            for bucket in self.buckets:
                bucket.absent = [slot for slot, position in enumerate(bucket.members)
                                 if position in missing]
        if self.alone:
            for bucket in self.buckets:
                self._start(bucket)
            self._started.clear()
            self.unused = set(absent)
            self.reset()
            return reduced
        with submission.together(self.settings.what):
            for bucket in self.buckets:
                self._adapter.pack([tensors[i] for i in bucket.members], bucket.grads)
                self._start(bucket)
        errors = self.wait()
        self.steps += 1
        if errors:
            raise errors[0]
        for bucket in self.buckets:
            for position, tensor in zip(bucket.members,
                                        self._adapter.unpack(bucket.flat, bucket.shapes)):
                reduced[position] = tensor
        return reduced

    # -- reductions -----------------------------------------------------------------------
    def _start(self, bucket: Bucket) -> None:
        bucket.inflight = []
        self._started.append(bucket)
        if bucket.flags is not None:
            bucket.flags[...] = 1
            for slot in bucket.absent:
                bucket.flags[slot] = 0
        if self.alone:      # nothing to send; HVDLITE_REPORT learns what P ranks would
            recorder = runtime.RUNTIME.recorder
            if recorder is not None:
                itemsize = to_dtype(self._dtypes[bucket.members[0]]).itemsize
                recorder.unreduced(bucket.total * itemsize)
            return
        if self._lane is not None:
            if not bucket.evicted:
                self._to_lane()
                return
            self._leave_lane()
        self._negotiate(bucket)

    def _leave_lane(self) -> None:
        """A sparse gradient was evicted (at this step, on every rank): its bucket no
        longer has the lane's size, so from here the buckets are negotiated, those
        started and still waiting for their turn on the lane too."""
        self._lane = None
        for bucket in self.buckets[self._lane_next:]:
            if bucket.inflight == [] and not bucket.evicted:
                self._negotiate(bucket)

    def _negotiate(self, bucket: Bucket) -> None:
        op, prescale, postscale = self.settings.scaled_op()
        compression = self.settings.compression
        buffers = self._adapter.buffers
        for piece in bucket.pieces():
            name, flat, prepared = piece
            wire, context = compression.compress(flat)
            if wire is flat:
                if prepared is None:
                    prepared = piece[2] = PreparedAllreduce(
                        buffers, flat, name, op, prescale, postscale, self.settings.process_set)
                handle = prepared.submit()
            else:        # a compressed copy of the bucket on the wire
                handle = collectives.allreduce_async(
                    buffers, wire, None, name, op, prescale, postscale,
                    self.settings.process_set, inplace=True)
            bucket.inflight.append((handle, flat, wire, context))

    def wait(self) -> list[HvdliteError]:
        """Wait for every started bucket (all of them, even after an error) and write
        compressed results back; returns the errors, and leaves the next step a clean
        start: nothing is left pending that no step would collect."""
        errors: list[HvdliteError] = []
        compression, buffers = self.settings.compression, self._adapter.buffers
        self.unused = set()
        try:
            for bucket in self._started:
                for handle, flat, wire, context in bucket.inflight or ():
                    if handle is _FAILED:
                        continue
                    try:
                        submission.synchronize(handle)
                        if wire is not flat:
                            buffers.pack([compression.decompress(wire, context)], flat)
                    except HvdliteError as error:
                        errors.append(error)
            if not errors:
                self.unused = self._unused_everywhere()
        finally:
            self.reset()
        if any(isinstance(error, lane.StepMismatchError) for error in errors):
            errors.insert(0, self._steps_everywhere())
        return errors

    def _steps_everywhere(self) -> MismatchError:
        """Every rank failed the same buckets on the lane for steps that differ:
        gather each rank's step to name them all."""
        steps = objects.allgather_object(self.steps, name=f"{self.settings.what}.steps",
                                         process_set=self.settings.process_set)
        named = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
        return MismatchError(
            f"rank {runtime.rank()}: the ranks reduced the gradients of different "
            f"optimizer steps together ({named}): a rank skipped a step, or took one "
            "more. Every rank must step as often as the others; this step's gradients "
            "were not handed back.")

    def _unused_everywhere(self) -> set[int]:
        """Of the gradients this rank lacked, those no rank had (their flags summed to
        0). Only a rank that lacked some reads its flags (from the device, if there)."""
        unused: set[int] = set()
        for bucket in self._started:
            for slot in bucket.absent:
                if bucket.flags is None or float(bucket.flags[slot]) == 0:
                    unused.add(bucket.members[slot])
        return unused

    def reset(self) -> None:
        self._lane_next = 0
        for bucket in self.buckets:
            bucket.waiting, bucket.inflight = len(bucket.members), None
            bucket.failed_slot = None
            if bucket.absent:
                bucket.absent = []
        self._started = []
        self._passes = [0] * len(self._passes)
