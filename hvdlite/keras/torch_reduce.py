"""Gradient averaging for Keras on the torch backend: its train step is eager
Python, so the gradients are torch tensors reduced with hvdlite.torch's grouped
allreduce (the engine fuses them); the settings match the TensorFlow path."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

import hvdlite as _hvd
from hvdlite.api.compression import Compression, Compressor
from hvdlite.api.gradients import Groups, check_settings, plan_groups, reduce_all
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.variable_check import check_same_variables
from hvdlite.torch.ops import OPS


@dataclasses.dataclass
class TorchGradientAverager:
    what: str
    compression: type[Compressor] = Compression.none
    sparse_as_dense: bool = False          # Keras' torch backend makes dense gradients
    op: int = _hvd.Average
    predivide: float = 1.0
    groups: Groups = None
    process_set: Optional[ProcessSet] = None
    checked: set = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        check_settings(1, self.op, self.predivide)
        self.compression = self.compression or Compression.none

    def __call__(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        specs = tuple((str(v.path), tuple(v.shape), str(v.dtype)) for v in variables)
        if specs not in self.checked:
            check_same_variables(specs, self.what, self.process_set)
            self.checked.add(specs)
        # A missing gradient takes part as zeros, so every rank submits every op.
        dense = [torch.zeros_like(v.value) if g is None else g
                 for g, v in zip(grads, variables)]
        by_id = {id(v): i for i, v in enumerate(variables)}
        plan = plan_groups(list(range(len(dense))), self.groups, key_of=lambda v: by_id[id(v)])
        with torch.no_grad():
            return reduce_all(OPS["grouped_allreduce"], dense, f"{self.what}.grads",
                              self.compression, self.op, self.predivide, plan,
                              self.process_set)
