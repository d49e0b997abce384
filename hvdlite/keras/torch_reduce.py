"""Gradient averaging for Keras on the torch backend: its train step is eager
Python, so the gradients are torch tensors reduced with hvdlite.torch's grouped
allreduce (the engine fuses them); the settings match the TensorFlow path."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from hvdlite.api.gradients import AveragerSettings, plan_groups, reduce_all
from hvdlite.api.variable_check import check_same_variables
from hvdlite.torch.ops import OPS


class TorchGradientAverager(AveragerSettings):
    """Keras' torch backend makes dense gradients (sparse_as_dense is moot)."""

    def __call__(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        shared, local = self.split_local(variables)
        result = list(grads)
        for i, value in zip(shared, self._reduce_shared([grads[i] for i in shared],
                                                        [variables[i] for i in shared])):
            result[i] = value
        scale = self.local_scale()
        for i in local:
            if result[i] is not None and scale != 1.0:
                result[i] = result[i] * scale
        return result

    def _reduce_shared(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        specs = tuple((str(v.path), tuple(v.shape), str(v.dtype)) for v in variables)
        if specs not in self.checked:
            check_same_variables(specs, self.what, self.process_set)
            self.checked.add(specs)
        # A missing gradient takes part as zeros, so every rank submits every op.
        dense = [torch.zeros_like(v.value) if g is None else g
                 for g, v in zip(grads, variables)]
        if self.alone() or not dense:
            return dense
        by_id = {id(v): i for i, v in enumerate(variables)}
        plan = plan_groups(list(range(len(dense))), self.groups, key_of=lambda v: by_id[id(v)])
        with torch.no_grad():
            return reduce_all(OPS["grouped_allreduce"], dense, f"{self.what}.grads",
                              self.compression, self.op, self.predivide, plan,
                              self.process_set)
