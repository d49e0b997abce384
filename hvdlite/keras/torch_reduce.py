"""Gradient averaging for Keras on the torch backend: its train step is eager
Python, so the gradients are torch tensors that go to the reducer's buckets in one
call (results are views of the buckets, which Keras applies at once). Also the
torch binding's support for the shared Keras optimizer (``hvdlite.keras.backend``)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from hvdlite.api.compression import Compression, Compressor
from hvdlite.api.process_set import ProcessSet
from hvdlite.diagnostics import report
from hvdlite.reduce_op import ReduceOp
from hvdlite.reducer.lists import GradientLists
from hvdlite.reducer.settings import Groups, Settings
from hvdlite.torch.adapter import TORCH


class TorchGradientAverager(GradientLists):
    """Keras' torch backend makes dense gradients (sparse_as_dense is moot)."""

    def __init__(self, what: str, compression: type[Compressor] = Compression.none,
                 sparse_as_dense: bool = False, op: int = ReduceOp.AVERAGE,
                 predivide: float = 1.0, groups: Groups = None,
                 process_set: Optional[ProcessSet] = None, scale_local: bool = True) -> None:
        super().__init__(TORCH, Settings(what, compression, op, predivide, 1, groups,
                                         process_set), scale_local)

    def reduce_shared(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        if not grads or self.settings.alone():
            return grads
        # A missing gradient takes part as zeros, so every rank reduces every bucket;
        # one that no rank has stays None, so Keras skips its variable.
        absent = [i for i, g in enumerate(grads) if g is None]
        dense = [torch.zeros_like(v.value) if g is None else g
                 for g, v in zip(grads, variables)]
        specs = [(str(v.path), tuple(g.shape), TORCH.dtype_name(g), TORCH.device(g))
                 for g, v in zip(dense, variables)]
        reducer = self.reducer(specs, variables)
        with torch.no_grad():
            reduced = reducer.reduce(dense, absent)
        return [None if i in reducer.unused else r for i, r in enumerate(reduced)]


# The torch binding's support for the shared Keras optimizer (hvdlite._keras.optimizer).
make_reducer = TorchGradientAverager


def entry_point(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keras' torch train step is eager Python: ``apply`` is entered as it is."""
    return fn


def mark_step(after: Sequence[Any]) -> None:
    """HVDLITE_REPORT: the step boundary, once the gradients are reduced."""
    recorder = report.recorder()
    if recorder is not None:
        recorder.step_done()
