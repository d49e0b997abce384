"""Horovod's ``ElasticSampler``: shards a data set by rank and resumes mid-epoch.

The sampler counts the samples processed this epoch over all ranks
(``record_batch``); its ``state_dict`` is (epoch, that count). After a restart,
at any world size, the epoch's order is rebuilt from (seed, epoch) and only the
samples after that count are sharded again, so none is repeated or skipped.
"""
from __future__ import annotations

import math
import random
from typing import Any, Iterator, Sized

import torch.utils.data

import hvdlite


class ElasticSampler(torch.utils.data.Sampler):
    """Like ``DistributedSampler``, plus the record of what was processed.

    Put it in the ``TorchState``, call ``record_batch`` after each batch and
    ``set_epoch(epoch + 1)`` at the end of each epoch (not at the start, which
    would forget what was processed of a resumed epoch).
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: a new order (with shuffle), nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of ``batch_size`` samples per rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Re-shard what is left of the epoch over the current world."""
        initialized = hvdlite.is_initialized()
        self.num_replicas = hvdlite.size() if initialized else 1
        self.rank = hvdlite.rank() if initialized else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            # The same permutation on every rank and after every restart.
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        # Pad by wrapping around so every rank gets the same number of samples.
        while len(indices) < self.total_size:
            indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
