"""Gradient averaging for Keras on the torch backend: its train step is eager
Python, so the gradients are torch tensors reduced with hvdlite.torch's grouped
allreduce (the engine fuses them); the settings match the TensorFlow path."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from hvdlite.api.gradients import AveragerSettings, plan_groups, reduce_all, scaled_op
from hvdlite.api.variable_check import check_same_variables
from hvdlite.torch.ops import OPS


class TorchGradientAverager(AveragerSettings):
    """Keras' torch backend makes dense gradients (sparse_as_dense is moot)."""

    def __call__(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        if self.outside_set():
            return list(grads)
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
        plan = self.bucket_layout([g.numel() * g.element_size() for g in dense],
                                  [(g.dtype, g.device) for g in dense])
        with torch.no_grad():
            if plan is not None:
                return self._reduce_buckets(dense, plan)
            by_id = {id(v): i for i, v in enumerate(variables)}
            groups = plan_groups(list(range(len(dense))), self.groups,
                                 key_of=lambda v: by_id[id(v)])
            return reduce_all(OPS["grouped_allreduce"], dense, f"{self.what}.grads",
                              self.compression, self.op, self.predivide, groups,
                              self.process_set)

    def _reduce_buckets(self, grads: list[Any], plan: list[list[int]]) -> list[Any]:
        """One flat in-place allreduce per bucket (one copy in); the results are
        views of the bucket, reshaped (no copy out)."""
        op, prescale, postscale = scaled_op(self.op, self.predivide, self.process_set)
        reduced = list(grads)
        for number, members in enumerate(plan):
            flat = torch.cat([grads[i].reshape(-1) for i in members])
            wire, context = self.compression.compress(flat)
            OPS["allreduce_"](wire, name=f"{self.what}.bucket.{number}", op=op,
                              prescale_factor=prescale, postscale_factor=postscale,
                              process_set=self.process_set)
            if wire is not flat:
                flat = self.compression.decompress(wire, context)
            parts = flat.split([grads[i].numel() for i in members])
            for i, part in zip(members, parts):
                reduced[i] = part.view(grads[i].shape)
        return reduced
