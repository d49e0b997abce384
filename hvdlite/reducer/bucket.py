"""One bucket of the reducer (hvdlite/reducer/buckets.py): a flat buffer, the gradients
viewing it, and the pieces it is reduced in around gradients reduced elsewhere."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from hvdlite.api.adapter import TensorAdapter

Spec = tuple[str, tuple[int, ...], str, str]     # (name, shape, dtype name, device)


class Bucket:
    """One flat buffer, the gradients viewing it, and this step's reduction."""

    def __init__(self, index: int, members: list[int], specs: Sequence[Spec], what: str,
                 buffers: Optional[TensorAdapter], words: int = 0) -> None:
        """``buffers``: the adapter that makes the flat buffer (None: no buffer, for a
        set of one rank, which reduces nothing); ``words``: check words at its end, for
        a bucket reduced on a lane (hvdlite/engine/lane.py)."""
        self.index = index
        self.members = members
        self.names = [specs[i][0] for i in members]
        # Named by its parameters, named alike on every rank and unlike in another
        # optimizer (a GAN's two): the engine caches its request under this name.
        self.name = f"{what}.bucket.{index}.{self.names[0]}..{self.names[-1]}"
        self.shapes = [specs[i][1] for i in members]
        counts = [math.prod(shape) for shape in self.shapes]
        self.offsets = [sum(counts[:slot]) for slot in range(len(counts))]
        self.counts = counts
        dtype, device = specs[members[0]][2:]
        total = self.total = sum(counts)      # the gradients' elements
        # The gradients, then one flag per gradient (see the module's docstring), then
        # the check words of a lane.
        self.flat = (None if buffers is None
                     else buffers.flat_buffer(dtype, device, total + len(members) + words))
        self.views = [None if buffers is None else buffers.view(self.flat, offset, shape)
                      for offset, shape in zip(self.offsets, self.shapes)]
        self.grads = None if buffers is None else self.flat[:total]
        self.flags = None if buffers is None else self.flat[total:total + len(members)]
        self.size = total + len(members) + words
        self.absent: list[int] = []          # slots without a gradient on this rank this step
        self.failed_slot: Optional[int] = None   # this rank failed it this step (on a lane)
        self.evicted: set[int] = set()       # slots reduced elsewhere
        self._pieces: Optional[list[list[Any]]] = None   # [name, flat piece, prepared]
        self.waiting = len(members)          # gradients not ready yet this step
        self.inflight: Optional[list[tuple[Any, Any, Any, Any]]] = None   # started

    def pieces(self) -> list[list[Any]]:
        """[name, piece of the flat buffer, its prepared request or None]: the whole
        buffer, or the runs of slots between evicted ones."""
        if self._pieces is None:
            if not self.evicted:
                self._pieces = [[self.name, self.flat, None]]
            else:
                runs: list[list[int]] = []
                spans = [(offset, count) for slot, (offset, count)
                         in enumerate(zip(self.offsets, self.counts)) if slot not in self.evicted]
                if spans:         # the flags, unless every gradient is reduced elsewhere
                    spans.append((self.total, self.size - self.total))
                for offset, count in spans:
                    if runs and runs[-1][1] == offset:
                        runs[-1][1] = offset + count
                    else:
                        runs.append([offset, offset + count])
                self._pieces = [[f"{self.name}.part{k}", self.flat[start:stop], None]
                                for k, (start, stop) in enumerate(runs)]
        return self._pieces

    def evict(self, slot: int) -> None:
        if slot not in self.evicted:
            self.evicted.add(slot)
            self._pieces = None
