"""Sparse tensors: reduced by allgathering every rank's coalesced indices and
values, so only non-zero rows travel (Horovod's sparse allreduce)."""
from __future__ import annotations

from typing import Optional

import torch

import hvdlite as _hvd
from hvdlite.api import collectives, submission
from hvdlite.api.process_set import ProcessSet
from hvdlite.errors import UsageError
from hvdlite.torch.adapter import TORCH


class SparseHandle:
    """The handle of ``sparse_allreduce_async``: ``synchronize`` returns the
    reduced, coalesced sparse tensor."""

    def __init__(self, indices: int, values: int, shape: torch.Size, scale: float) -> None:
        self.indices, self.values, self.shape, self.scale = indices, values, shape, scale

    def __call__(self) -> torch.Tensor:
        """Horovod's sparse handles are called to wait for the result."""
        return self.result()

    def result(self) -> torch.Tensor:
        indices = submission.synchronize(self.indices)
        values = submission.synchronize(self.values)
        if self.scale != 1.0:
            values = values * self.scale
        # Duplicate coordinates from different ranks add up when coalescing. Checked:
        # a peer with another shape would send indices out of range (a crash unchecked).
        return torch.sparse_coo_tensor(indices.t(), values, self.shape,
                                       check_invariants=True).coalesce()


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None,
                           op: Optional[int] = None,
                           process_set: Optional[ProcessSet] = None) -> SparseHandle:
    """Start reducing a sparse COO tensor (op=Average or Sum): every rank's coalesced
    indices and values are allgathered, so only non-zero rows travel."""
    reduction = _hvd.Average if op is None else op
    if reduction not in (_hvd.Average, _hvd.Sum):
        raise UsageError("sparse_allreduce_async reduces with op=Average or Sum")
    if not (TORCH.is_tensor(tensor) and tensor.is_sparse):
        raise UsageError("sparse_allreduce_async expects a sparse COO torch tensor")
    coalesced = tensor.detach().coalesce()
    # Rows are non-zeros: indices as (nnz, sparse_dim) so allgather concatenates them.
    indices = coalesced.indices().t().contiguous()
    values = coalesced.values().contiguous()
    names = (None, None) if name is None else (f"{name}.indices", f"{name}.values")
    handles = (collectives.allgather_async(TORCH, indices, names[0], process_set),
               collectives.allgather_async(TORCH, values, names[1], process_set))
    size = _hvd.size() if process_set is None else process_set.size()
    scale = 1.0 / size if reduction == _hvd.Average else 1.0
    return SparseHandle(*handles, coalesced.shape, scale)
