"""``ZeroRedundancyOptimizer``: the optimizer's state sharded across the ranks (ZeRO
stage 1, with stage 2's reduce-scatter of the gradients to their owners; the gradients
themselves stay whole on every rank), with torch's signature and methods, in place of
``DistributedOptimizer`` in a training loop.

Every element of every parameter has one owner (layout.py: flat spaces in chunks,
each split evenly between the ranks). Each step:

1. the gradients are reduced **to their owners only**: a reduce-scatter per chunk of
   each space, with each rank's part as its count, averaged;
2. which parameters had a gradient on any rank: one that no rank had is skipped, as
   in one process (a frozen or unused layer: Adam does not move it);
3. the wrapped optimizer steps this rank's pieces only: views into the parameters'
   own memory, so it updates them in place, and its state is this rank's share;
4. the updated pieces are gathered to every rank (an allgather per chunk, the same
   chunks), and copied into the parameters.

A float32 or float64 space on the CPU goes on lanes where the transport has them
(lanes.py; MPI, the node's shared memory, Gloo): every chunk every step with no
negotiation round, and the flags of step 2 inside the reduce-scatter. There step 1
starts in backward, chunk by chunk as their gradients come (overlap.py). Elsewhere
(rounds.py) one small allreduce agrees on step 2 first, and only the chunks it names
are negotiated. The gradients live in one flat buffer per space, each ``.grad`` a
view of it (grads.py).

Every element is written by its one owner and copied to the others, so every rank
holds bitwise the same parameters by construction. The wrapped optimizer sees each
piece as a flat run of elements, so it must act element by element (SGD, Adam,
AdamW, RMSprop, Adagrad and the like); one that reads a whole tensor (a norm, as
LAMB does) would see parts.

``clip_grad_norm_`` (clip.py) runs steps 1 and 2 early and clips the averaged
shares by their total norm; ``step()`` then goes on from them, unless a new gradient
arrived since (a post-accumulate hook forgets the early reduction).

``torch.amp.GradScaler`` (amp.py): the scaler's question whether the optimizer
scales by itself reduces early too, and the ranks agree on an overflow there, so
every rank skips alike.

Checkpoints (state.py): ``consolidate_state_dict(to)`` gathers the state to one
rank in the plain optimizer's format, which loads into ``optimizer_class`` over the
same parameters, and into a ZeroRedundancyOptimizer at any world size.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from hvdlite.api import runtime, submission
from hvdlite.api.process_set import ProcessSet, global_process_set
from hvdlite.api.variable_check import check_same_variables
from hvdlite.config_values import ONE_BUCKET
from hvdlite.errors import HvdliteError, NotSupportedError, UsageError
from hvdlite.torch import hooks
from hvdlite.torch.adapter import dtype_name
from hvdlite.torch.mpi_ops import Max, allreduce
from hvdlite.torch.zero import amp as zero_amp
from hvdlite.torch.zero import clip as zero_clip
from hvdlite.torch.zero import grads as zero_grads
from hvdlite.torch.zero import lanes as zero_lanes
from hvdlite.torch.zero import overlap as zero_overlap
from hvdlite.torch.zero import rounds as zero_rounds
from hvdlite.torch.zero import state as zero_state
from hvdlite.torch.zero.layout import Space, lay_out

MAX_CHUNK_BYTES = 25 << 20     # a chunk where HVDLITE_BUCKET_BYTES asks for one bucket


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """torch's ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)``, with
    Horovod's ``process_set`` in place of ``process_group``: collective, every rank of
    the set makes one with the same parameters, in the same order."""

    def __init__(self, params: Iterable[Any], optimizer_class: type,
                 process_set: ProcessSet = global_process_set, *, process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any) -> None:
        """torch's ``parameters_as_bucket_view`` is taken and changes nothing (the
        parameters keep their own memory; gradients live in flat buffers here anyway);
        ``overlap_with_ddp`` and a torch ``process_group`` are refused: there is no DDP
        under hvdlite, and its ranks are a ``process_set``."""
        self._built = False
        if process_group is not None or not isinstance(process_set, ProcessSet):
            raise UsageError(
                f"rank {runtime.rank()}: ZeroRedundancyOptimizer takes process_set= (an "
                "hvdlite ProcessSet, registered with add_process_set), not a torch process "
                f"group: got {process_group if process_group is not None else process_set!r}")
        if overlap_with_ddp:
            raise NotSupportedError(
                f"rank {runtime.rank()}: ZeroRedundancyOptimizer(overlap_with_ddp=True) needs "
                "torch's DDP; under hvdlite it replaces DDP and DistributedOptimizer, so drop "
                "the DDP wrapper and the flag")
        super().__init__(params, defaults)
        if not process_set.included():
            raise UsageError(
                f"rank {runtime.rank()}: ZeroRedundancyOptimizer's process set "
                f"{process_set.ranks} does not hold this rank; make it on the set's ranks "
                "only, each with the same parameters")
        self.optimizer_class, self.process_set = optimizer_class, process_set
        # Counted per set (only its ranks make one): named alike on every rank of it.
        set_id = submission.set_ranks(process_set)[0]
        self._what = runtime.next_name(set_id, "ZeroRedundancyOptimizer")[0]
        self._consolidated: Optional[dict[str, Any]] = None
        self._layouts = 0            # layouts made so far: names each one's exchange
        self._steps = 0              # steps taken: the lanes' check words carry it
        hooks.claim([p for group in self.param_groups for p in group["params"]], self)
        self._build()

    # -- layout ---------------------------------------------------------------------------
    def _build(self) -> None:
        """Lay the parameters out (agreed by every rank) and make the wrapped optimizer
        over this rank's pieces, one group per group."""
        params = [p for group in self.param_groups for p in group["params"]]
        check_same_variables([(f"parameter {i}", tuple(p.shape), dtype_name(p.dtype))
                              for i, p in enumerate(params)], self._what, self.process_set,
                             name=f"{self._what}.layout.{self._layouts}")
        self._layouts += 1
        with torch.no_grad():
            for param in params:
                if not param.is_contiguous():     # pieces are views of its memory
                    param.data = param.data.contiguous()
        self._params = params
        self._spaces = lay_out(params, self.process_set.rank(), self.process_set.size(),
                               _chunk_bytes(runtime.config().bucket_bytes))
        self._lanes = self._open_lanes()
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        self._reduced: Optional[list[bool]] = None   # this step's, once reduced
        self._pieces: list[tuple[Space, Any, torch.Tensor]] = []
        if getattr(self, "_grads", None) is not None:
            self._grads.remove()
        self._grads = zero_grads.FlatGradients(self)
        self._passes = zero_overlap.BackwardPasses(self)
        local_groups = [{**zero_state.hyperparameters(group), "params": []}
                        for group in self.param_groups]
        for space in self._spaces:
            for piece in space.pieces:
                tensor = self._view(piece)
                self._pieces.append((space, piece, tensor))
                local_groups[group_of[piece.position]]["params"].append(tensor)
        # This rank's pieces in each chunk, in order: its part of the chunk, joined.
        self._pieces_by_chunk: dict[tuple[int, int], list[torch.Tensor]] = {}
        for space, piece, tensor in self._pieces:
            self._pieces_by_chunk.setdefault((space.index, piece.chunk), []).append(tensor)
        self._local = self.optimizer_class(local_groups, **self.defaults)
        for group, local in zip(self.param_groups, self._local.param_groups):
            for key, value in local.items():    # the wrapped optimizer's defaults, shown
                if key != "params":
                    group.setdefault(key, value)
        self._built = True

    def _open_lanes(self) -> dict[int, zero_lanes.SpaceLanes]:
        """Lanes for the spaces whose chunks can go on them (lanes.py), by space;
        alike on every rank (the same layout and transport)."""
        lanes = {}
        for space in self._spaces:
            if zero_lanes.carried(space):
                opened = zero_lanes.SpaceLanes(
                    f"{self._what}.layout.{self._layouts - 1}", space, self._params,
                    self.process_set.rank(), self.process_set.size(), self.process_set)
                if opened.opened:
                    lanes[space.index] = opened
        return lanes

    def _view(self, piece: Any) -> torch.Tensor:
        """A leaf over the piece's elements of its parameter (no gradient needed: a
        tensor that needs none is a leaf, and the optimizer updates it in place)."""
        return self._params[piece.position].detach().view(-1)[piece.start:piece.stop]

    def _refresh_views(self) -> None:
        """A parameter given new memory (``param.data = ...``) since: its pieces follow it,
        keeping their identity (the wrapped optimizer's state is keyed by them)."""
        for _, piece, tensor in self._pieces:
            param = self._params[piece.position]
            if tensor.data_ptr() != param.data_ptr() + piece.start * param.element_size():
                tensor.data = self._view(piece)

    # -- a step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        anywhere, self._reduced = self._reduce_once(), None
        try:
            if zero_amp.under_scaler(self) and zero_amp.unscaled_or_skipped(self):
                return loss                        # skipped on every rank alike
            for group, local in zip(self.param_groups, self._local.param_groups):
                local.update(zero_state.hyperparameters(group))   # a scheduler changes them
            try:
                self._local.step()
            except BaseException:
                self._gather_failed(anywhere)
                raise
            self._allgather(anywhere)
        finally:
            self._steps += 1
            for _, _, tensor in self._pieces:
                tensor.grad = None
        return loss

    def _gather_failed(self, anywhere: list[bool]) -> None:
        """This rank's step raised: the lanes' allgathers fail on every rank (each names
        this rank), and this rank raises its own error."""
        if self._lanes:
            try:
                self._allgather(anywhere, failed=True)
            except HvdliteError:
                pass

    def _reduce_once(self) -> list[bool]:
        """Flags, then each rank's averaged gradients in its pieces' ``.grad``, unless
        done since the last gradient arrived; which parameters had one on any rank."""
        if self._reduced is None:
            self._refresh_views()
            taken = self._passes.take()        # reduced in backward, if still current
            for position in range(len(self._params)):   # where no hook ran: none, or set
                self._grads.into_view(position)
            flags = [zero_lanes.flag(p.grad) for p in self._params]
            received = taken if taken is not None else self._reduce_on_lanes()
            anywhere = self._gradients_anywhere(flags, received)
            self._reduce_scatter(anywhere, received)
            self._reduced = anywhere
        return self._reduced

    def _reduce_on_lanes(self) -> dict[int, list[Any]]:
        """The lanes' spaces reduced now (lanes.py): each one's parts, chunk by
        chunk, each with the summed flags of its parameters."""
        return {index: lanes.reduce(self._grads.flat[index], self._steps)
                for index, lanes in self._lanes.items()}

    def _start_chunk(self, lanes: zero_lanes.SpaceLanes, k: int) -> None:
        """Chunk ``k`` of a space on lanes, in backward (overlap.py): its gradients
        in their views first (none: zeros)."""
        for position in lanes.space.chunks[k].positions:
            self._grads.into_view(position)
        lanes.start_reduce(k, self._grads.flat[lanes.space.index], self._steps)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Collective, between the last ``backward()`` and ``step()``: clips the averaged
        gradients by their total norm, as ``torch.nn.utils.clip_grad_norm_`` would
        after DDP's backward, and returns that norm (alike on every rank). The
        gradients are reduced here, and ``step()`` goes on from them. Clipping
        ``model.parameters()`` with torch's function instead would clip each rank's own
        gradients before they are averaged."""
        with torch.no_grad():
            self._reduce_once()
            return zero_clip.clip(self, max_norm, norm_type, error_if_nonfinite)

    def synchronize(self) -> None:
        """Refused: see ``skip_synchronize``."""
        self.skip_synchronize()

    def skip_synchronize(self) -> Any:
        """Refused on every rank alike: Horovod's ``synchronize()`` then clipping
        ``model.parameters()`` would clip gradients this optimizer no longer steps from
        (each rank steps its own share of the averaged ones)."""
        raise NotSupportedError(
            f"rank {runtime.rank()}: {self._what}: synchronize() and skip_synchronize() "
            "are DistributedOptimizer's; here each rank holds the averaged gradients of "
            "its own share only, so clipping model.parameters() after synchronize() "
            "would change nothing that step() uses. Call "
            "optimizer.clip_grad_norm_(max_norm) before step() instead")

    def _gradients_anywhere(self, flags: list[float],
                            received: dict[int, list[Any]]) -> list[bool]:
        """Which parameters had a gradient on any rank: from the lanes' flags, and from
        one allreduce where a space is not on a lane."""
        found = flags
        if len(self._lanes) < len(self._spaces) and flags:
            found = allreduce(torch.tensor(flags, dtype=torch.float32), op=Max,
                              name=f"{self._what}.gradients",
                              process_set=self.process_set).tolist()
        for index, parts in received.items():
            found = self._lanes[index].flags(parts, found)
        sparse = [i for i, flag in enumerate(found) if flag == zero_lanes.SPARSE]
        if sparse:
            mine = [i for i in sparse if self._params[i].grad is not None
                    and self._params[i].grad.is_sparse]
            where = "this rank" if mine else "another rank"
            raise UsageError(
                f"rank {runtime.rank()}: {self._what}: parameter {sparse[0]} has a sparse "
                f"gradient on {where}; ZeroRedundancyOptimizer shards dense gradients only "
                "(use DistributedOptimizer, or an embedding with sparse=False)")
        return [flag != 0.0 for flag in found]

    def _reduce_scatter(self, anywhere: list[bool], received: dict[int, list[Any]]) -> None:
        """Each chunk's gradients averaged into its owners' parts (the lanes' ``received``
        already); the pieces' ``.grad`` views of this rank's parts (None where no rank
        had a gradient)."""
        parts = zero_rounds.reduce_scatter(
            self._what, [s for s in self._spaces if s.index not in self._lanes],
            [f for s, f in zip(self._spaces, self._grads.flat) if s.index not in self._lanes],
            anywhere, self.process_set)
        parts.update({(index, k): torch.from_numpy(part) for index, each in received.items()
                      for k, part in enumerate(each)})
        for space, piece, tensor in self._pieces:
            if anywhere[piece.position]:
                begin = piece.offset - space.chunks[piece.chunk].mine[0]
                part = parts[(space.index, piece.chunk)]
                tensor.grad = part[begin:begin + piece.stop - piece.start]

    def _allgather(self, anywhere: list[bool], failed: bool = False) -> None:
        """The stepped parameters, from their owners to every rank; ``failed``: this
        rank's step raised (only the lanes then go, each failing on every rank)."""
        by_chunk = self._pieces_by_chunk
        for index, lanes in self._lanes.items():
            lanes.gather(lambda k, index=index: by_chunk.get((index, k), []), self._steps,
                         failed)
        if not failed:
            zero_rounds.allgather(self._what,
                                  [s for s in self._spaces if s.index not in self._lanes],
                                  by_chunk, self._params, anywhere, self.process_set)

    # -- torch's other methods --------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Collective once made: the layout is made again, every rank's state kept."""
        if not getattr(self, "_built", False):
            super().add_param_group(param_group)
            return
        state = zero_state.gather(self, keep=True)
        super().add_param_group(param_group)
        hooks.claim(self.param_groups[-1]["params"], self)
        self._build()
        state["param_groups"] = zero_state.groups(self)     # the new one added, no state
        zero_state.load(self, state)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: the whole state gathered to rank ``to`` of the process set, for its
        ``state_dict()``."""
        self._consolidated = zero_state.gather(self, keep=self.process_set.rank() == to)

    def state_dict(self) -> dict[str, Any]:
        """The plain ``optimizer_class``'s state dict over the same parameters, on the rank
        ``consolidate_state_dict`` gathered to."""
        if self._consolidated is None:
            raise UsageError(
                f"rank {runtime.rank()}: {self._what}: state_dict() is on the rank that "
                "consolidate_state_dict(to=...) gathered to; call consolidate_state_dict() "
                "on every rank first")
        consolidated, self._consolidated = self._consolidated, None
        return consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Collective: a whole state dict (``state_dict()``'s, or the plain optimizer's),
        each rank keeping its share; from any world size."""
        zero_state.load(self, state_dict)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Asked by ``GradScaler.step`` on every rank before it checks the gradients
        (amp.py): this step's gradients are reduced here, and every rank's check
        shows an overflow where any rank's share holds one."""
        with torch.no_grad():
            self._reduce_once()
            zero_amp.agree_on_overflow(self)
        return True

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer, over this rank's pieces."""
        return self._local


def _chunk_bytes(bucket_bytes: int) -> int:
    """HVDLITE_BUCKET_BYTES, but never one bucket of everything (the default where ranks
    share cores, to save rounds): here a chunk in flight is memory on top of the model,
    and one of the model's size would take back what the shards save."""
    return MAX_CHUNK_BYTES if bucket_bytes >= ONE_BUCKET else bucket_bytes
