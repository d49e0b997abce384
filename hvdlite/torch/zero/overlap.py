"""A ZeroRedundancyOptimizer's reduce-scatters overlapped with backward, where its spaces
go on lanes (lanes.py).

In every backward pass, every chunk of every such space is reduce-scattered once, last
chunk first, as backward makes the gradients: a chunk goes as soon as each of its
parameters that requires a gradient has one from this pass, and the chunks still
waiting (a parameter this rank did not use) go when the pass ends (a callback that
autograd runs then). So every rank starts the same chunks in the same order, pass after
pass, whatever it used, and the lanes pair them up with no round.

Several passes before a step (gradient accumulation) reduce every chunk in each, the
last of them over the gradients summed so far: ``step()`` takes the last pass's parts.
It reduces again itself where the gradients changed after the pass: a gradient set by
hand, or one changed in place (their memory's version counter moved), or one cleared.
The ranks do so alike where their code is alike; a rank that alone changed its
gradients is out of step, and a MismatchError or a deadlock's error on every rank.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

if TYPE_CHECKING:
    from hvdlite.torch.zero.optimizer import ZeroRedundancyOptimizer


class BackwardPasses:
    """The reduce-scatters started in backward, for one optimizer's layout."""

    def __init__(self, opt: "ZeroRedundancyOptimizer") -> None:
        self._opt = opt
        self._in_pass = False
        self._passed = False                 # a pass ended since the last step took it
        self._next: dict[int, int] = {}      # by space: chunks started this pass
        self._waiting: dict[int, list[set[int]]] = {}   # by space, chunk: still to come
        self._chunks_of: dict[int, tuple[int, list[int]]] = {}   # position: space, chunks
        for index in opt._lanes:
            for k, chunk in enumerate(opt._spaces[index].chunks):
                for position in chunk.positions:
                    self._chunks_of.setdefault(position, (index, []))[1].append(k)
        self._versions: dict[int, int] = {}
        self._had: list[bool] = []           # which parameters had a gradient, at the end

    def arrived(self, position: int) -> None:
        """A post-accumulate hook: parameter ``position`` has this pass's gradient."""
        where = self._chunks_of.get(position)
        if where is None:
            return
        if not self._in_pass:
            self._begin()
        index, chunks = where
        for k in chunks:
            self._waiting[index][k].discard(position)
        self._start_ready(index)

    def _begin(self) -> None:
        self._in_pass = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end)
        params = self._opt._params
        for index in self._opt._lanes:
            self._next[index] = 0
            self._waiting[index] = [{p for p in chunk.positions if params[p].requires_grad}
                                    for chunk in self._opt._spaces[index].chunks]

    def _start_ready(self, index: int, every: bool = False) -> None:
        """The chunks whose turn it is, while their gradients are in (``every``: all
        that are left, at the pass's end)."""
        lanes, waiting = self._opt._lanes[index], self._waiting[index]
        while self._next[index] < len(lanes.order):
            k = lanes.order[self._next[index]]
            if waiting[k] and not every:
                return
            self._opt._start_chunk(lanes, k)
            self._next[index] += 1

    def _end(self) -> None:
        """Autograd's callback at the pass's end (or ``take``, for a pass that raised)."""
        if not self._in_pass:
            return
        for index in self._opt._lanes:
            self._start_ready(index, every=True)
        self._in_pass, self._passed = False, True
        self._versions = {i: self._opt._grads.flat[i]._version for i in self._opt._lanes}
        self._had = [p.grad is not None for p in self._opt._params]

    def take(self) -> Optional[dict[int, list[np.ndarray]]]:
        """At a step: the last pass's parts by space, if its gradients are still the
        ones there; None where there was no pass, or they changed (the step reduces)."""
        self._end()
        if not self._passed:
            return None
        self._passed = False
        opt = self._opt
        received = {index: lanes.finish_reduce() for index, lanes in opt._lanes.items()}
        current = [p.grad is not None for p in opt._params]
        if current != self._had or any(
                opt._grads.flat[i]._version != version for i, version in self._versions.items()):
            return None
        for position in self._chunks_of:          # a sparse one fails every rank later
            grad = opt._params[position].grad
            if grad is not None and not grad.is_sparse and grad is not opt._grads.views[position]:
                return None
        return received
