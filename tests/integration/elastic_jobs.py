"""Elastic training programs for the restart tests (run under hvdliterun --elastic or
in a SLURM job): a small deterministic torch model trained with hvd.elastic.run.

Environment (test settings, not hvdlite knobs):
  ELASTIC_OUT       rank 0 writes the final parameters and the samples seen here (JSON)
  ELASTIC_SHUFFLE   1: the ElasticSampler shuffles
  ELASTIC_FAULT     kill_after_commit: rank 1 SIGKILLs itself right after commit N
                    kill_in_write: rank 0 SIGKILLs itself inside commit N's write,
                    between the fsync of the temporary file and the rename
                    preempt: rank 1 sends itself SIGUSR1 after commit N (as SLURM would)
                    wait_usr1: after commit N, every rank waits for SIGUSR1 from outside
  ELASTIC_FAULT_AT  N (default 5)
  ELASTIC_MARKER    a file created when the fault fires, so it fires in one attempt only
  ELASTIC_STEP_SLEEP  seconds to sleep per step (to leave time to send a signal)
  SURVIVORS_SPEAK   1: ignore SIGTERM (torchrun's agent ends the others with it)
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Callable

import torch

import hvdlite.torch as hvd
from hvdlite.elastic import persist

EPOCHS = 3
SAMPLES = 48
BATCH = 4          # per rank


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 6, generator=gen)
        self.y = self.x @ torch.arange(1.0, 7.0).unsqueeze(1) + 0.5

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):   # type: ignore[no-untyped-def]
        return self.x[i], self.y[i], i


def _fault_fires(commits: int) -> bool:
    fault = os.environ.get("ELASTIC_FAULT", "")
    marker = os.environ.get("ELASTIC_MARKER", "")
    if not fault or commits != int(os.environ.get("ELASTIC_FAULT_AT", "5")):
        return False
    if marker and os.path.exists(marker):
        return False
    return True


def _mark() -> None:
    marker = os.environ.get("ELASTIC_MARKER")
    if marker:
        with open(marker, "w") as handle:   # the job id: the SLURM test signals that job
            handle.write(os.environ.get("SLURM_JOB_ID", "fired") + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def _after_commit(state: hvd.elastic.TorchState) -> None:
    fault = os.environ.get("ELASTIC_FAULT", "")
    if not _fault_fires(state._commits):
        return
    if fault == "kill_after_commit" and hvd.rank() == 1:
        _mark()
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "preempt" and hvd.rank() == 1:
        _mark()
        os.kill(os.getpid(), signal.SIGUSR1)
    if fault == "wait_usr1":
        if hvd.rank() == 0:
            _mark()     # tells the test to send the signal now
        print(f"WAITING rank {hvd.rank()}", flush=True)


def _arm_write_fault(state: hvd.elastic.TorchState) -> None:
    """kill_in_write: the next write (commit N) dies between fsync and rename."""
    if (os.environ.get("ELASTIC_FAULT") == "kill_in_write" and hvd.rank() == 0
            and _fault_fires(state._commits + 1)):
        def die() -> None:
            _mark()
            os.kill(os.getpid(), signal.SIGKILL)
        persist.before_rename = die


def _commit(state: hvd.elastic.TorchState) -> None:
    _arm_write_fault(state)
    state.commit()
    _after_commit(state)


def train_epochs(state: hvd.elastic.TorchState, data: Data, epochs: int = EPOCHS,
                 commit: Callable[[hvd.elastic.TorchState], None] = _commit) -> None:
    """The epochs from ``state.epoch`` on: ``commit`` every second step and at each
    epoch's end, the samples every rank trained on recorded in ``state.seen``."""
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=state.sampler)
    loss_fn = torch.nn.MSELoss()
    pause = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))
    for epoch in range(state.epoch, epochs):
        for batch_idx, (x, y, index) in enumerate(loader):
            state.optimizer.zero_grad()
            loss_fn(state.model(x), y).backward()
            state.optimizer.step()
            state.seen.append([epoch] + hvd.allgather(index, name="seen").tolist())
            state.sampler.record_batch(batch_idx, BATCH)
            time.sleep(pause)
            if batch_idx % 2 == 1:
                commit(state)
        state.sampler.set_epoch(epoch + 1)
        state.epoch = epoch + 1
        commit(state)


@hvd.elastic.run
def _train(state: hvd.elastic.TorchState, data: Data) -> None:
    if hvd.rank() == 0:
        print(f"START commits={state._commits} epoch={state.epoch} "
              f"processed={state.sampler.processed_num}", flush=True)
    train_epochs(state, data)


def train() -> None:
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    data = Data()
    sampler = hvd.elastic.ElasticSampler(data, shuffle=os.environ.get("ELASTIC_SHUFFLE") == "1",
                                         seed=3)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, seen=[])
    _train(state, data)
    if hvd.rank() == 0:
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        with open(os.environ["ELASTIC_OUT"], "w") as handle:
            json.dump({"params": params.numpy().tobytes().hex(), "seen": state.seen,
                       "size": hvd.size()}, handle)
    print(f"DONE rank {hvd.rank()}", flush=True)


def rank_times(factor: int, offset: int = 0) -> tuple[int, float]:
    """For hvdlite.run: (rank, factor * the sum of ranks + offset)."""
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="run.sum")
    return hvd.rank(), factor * float(total[0]) + offset


def fail_always() -> None:
    """A deterministic bug: every attempt fails the same way."""
    hvd.init()
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0)

    @hvd.elastic.run
    def work(state: hvd.elastic.ObjectState) -> None:
        if hvd.rank() == hvd.size() - 1:
            raise ValueError("deliberate bug in the training script")
        hvd.allreduce(torch.ones(2), name="never.completes")

    work(state)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if os.environ.get("SURVIVORS_SPEAK") == "1":     # as in torchrun_jobs.py
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    globals()[sys.argv[1]]()
