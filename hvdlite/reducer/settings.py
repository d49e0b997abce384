"""What a DistributedOptimizer or a gradient tape asks of the reducer, checked once,
and what follows from it: the scale factors, whether this rank reduces at all."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

from hvdlite.api import runtime
from hvdlite.api.compression import Compression, Compressor
from hvdlite.api.process_set import ProcessSet
from hvdlite.errors import UsageError
from hvdlite.reduce_op import ReduceOp

# groups=: a number of groups of consecutive parameters, or lists of parameters.
Groups = Union[None, int, Sequence[Sequence[Any]]]


@dataclasses.dataclass(frozen=True)
class Settings:
    """One averager's settings (the refusals every framework shares are here)."""
    what: str = "DistributedOptimizer"       # names its requests and its errors
    compression: type[Compressor] = Compression.none
    op: int = ReduceOp.AVERAGE
    predivide: float = 1.0                   # Horovod's gradient_predivide_factor
    passes: int = 1                          # backward_passes_per_step
    groups: Groups = None
    process_set: Optional[ProcessSet] = None

    def __post_init__(self) -> None:
        if self.passes < 1:
            raise UsageError("backward_passes_per_step must be >= 1")
        if self.op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise UsageError("DistributedOptimizer reduces gradients with op=Average or Sum")
        if self.predivide != 1.0 and self.op != ReduceOp.AVERAGE:
            raise UsageError("gradient_predivide_factor needs op=Average")
        if isinstance(self.groups, int) and self.groups < 1:
            raise UsageError("groups must be a positive number of groups or a list of lists")
        if self.compression is None:         # Horovod scripts pass None for "none"
            object.__setattr__(self, "compression", Compression.none)

    def set_size(self) -> int:
        return self.process_set.size() if self.process_set else runtime.size()

    def outside(self) -> bool:
        """This rank is not in the process set: as in Horovod, its gradients stay its
        own (the set's members reduce among themselves)."""
        return self.process_set is not None and not self.process_set.included()

    def alone(self) -> bool:
        """A set of one rank: the average (or sum) of a gradient is the gradient, so
        nothing is sent and a one-GPU run of a distributed script pays nothing per
        step (measured on an H100: the engine's round trips otherwise added about 2x
        to a small ResNet's step), unless HVDLITE_ONE_RANK_SHORTCUT=0 asks one rank
        to take the multi-rank path."""
        return (self.set_size() == 1 and self.predivide == 1.0
                and runtime.config().one_rank_shortcut)

    def scaled_op(self) -> tuple[int, float, float]:
        """(op, prescale, postscale): with a predivide factor, Average becomes Sum with
        the division split around the sum (Horovod's gradient_predivide_factor)."""
        if self.predivide == 1.0:
            return self.op, 1.0, 1.0
        return ReduceOp.SUM, 1.0 / self.predivide, self.predivide / self.set_size()
