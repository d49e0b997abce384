"""An elastic training program whose world changes size between restarts, run by
tests/integration/test_elastic_resize.py under hvdliterun --elastic with a host
discovery script that prints the file RESIZE_HOSTS.

Environment (test settings, not hvdlite knobs):
  RESIZE_HOSTS  the file the discovery script prints ('localhost:N')
  RESIZE_PLAN   'size:commit:hosts,...': when the world has `size` ranks and commit
                number `commit` is done, the last rank writes `hosts` to RESIZE_HOSTS
                and SIGKILLs itself (a host is lost, or the job is made to restart
                after one came back). Under torchrun (tests/integration/test_torchrun.py)
                `hosts` names what happens to the last rank's node instead:
                  lose-node      its agent is SIGKILLed, then the rank
                  wait-for-node  the rank writes 'waiting' to RESIZE_HOSTS and waits for
                                 the restart a joining node brings (its agent stops it)
  RESIZE_OUT    each rank writes its final parameters to RESIZE_OUT.<rank>.json; rank 0
                adds the samples seen (per step, every rank's, as committed)
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import hvdlite.torch as hvd
from tests.integration.elastic_jobs import Data, train_epochs

EPOCHS = 2
BASE_LR = 0.01     # per rank: the rate is BASE_LR * hvd.size()
NODE_WAIT_S = 120


def _plan() -> dict[tuple[int, int], str]:
    steps = {}
    for item in filter(None, os.environ.get("RESIZE_PLAN", "").split(",")):
        size, commit, hosts = item.split(":", 2)
        steps[(int(size), int(commit))] = hosts
    return steps


def _commit(state: hvd.elastic.TorchState) -> None:
    state.commit()
    hosts = _plan().get((hvd.size(), state._commits))
    if hosts is None or hvd.rank() != hvd.size() - 1:
        return
    if hosts == "lose-node":
        os.kill(os.getppid(), signal.SIGKILL)      # torchrun's agent: the node is gone
    with open(os.environ["RESIZE_HOSTS"], "w") as handle:
        handle.write("waiting\n" if hosts == "wait-for-node" else hosts.replace(";", "\n") + "\n")
    if hosts == "wait-for-node":
        time.sleep(NODE_WAIT_S)                   # the agent's restart ends this process
        sys.exit(f"no node joined within {NODE_WAIT_S} s")
    os.kill(os.getpid(), signal.SIGKILL)


def _lr(state: hvd.elastic.TorchState) -> float:
    return float(state.optimizer.param_groups[0]["lr"])


@hvd.elastic.run
def _train(state: hvd.elastic.TorchState, data: Data) -> None:
    if hvd.rank() == 0:
        print(f"START size={hvd.size()} commits={state._commits} epoch={state.epoch} "
              f"processed={state.sampler.processed_num} lr={_lr(state):g}", flush=True)
    train_epochs(state, data, EPOCHS, _commit)


def train() -> None:
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    data = Data()
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, seen=[])

    def on_state_reset() -> None:
        # The committed optimizer carries the rate of the world that committed it.
        for group in optimizer.param_groups:
            group["lr"] = BASE_LR * hvd.size()
        if hvd.rank() == 0:
            print(f"RESET size={hvd.size()} commits={state._commits}", flush=True)

    state.register_reset_callbacks([on_state_reset])
    _train(state, data)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    result = {"params": params.numpy().tobytes().hex(), "size": hvd.size(), "lr": _lr(state)}
    if hvd.rank() == 0:
        result["seen"] = state.seen
    with open(f"{os.environ['RESIZE_OUT']}.{hvd.rank()}.json", "w") as handle:
        json.dump(result, handle)
    print(f"DONE rank {hvd.rank()}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    globals()[sys.argv[1]]()
