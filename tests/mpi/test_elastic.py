"""hvd.elastic on every rank: commit/restore/sync of ObjectState and TorchState,
in-process recovery by the run decorator, preemption agreed across ranks, the
committed file, ElasticSampler resuming, and the bad inputs (an attribute that
cannot be pickled, a committed file of another state)."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api.control import reconfigure
from hvdlite.elastic import persist, preemption

torch = pytest.importorskip("torch")

import hvdlite.torch as hvdt  # noqa: E402

pytestmark = pytest.mark.timeout(60)



def test_object_state_commit_restore_sync() -> None:
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=hvd.rank(), log=[])
    state.sync()                                    # everyone takes rank 0's values
    assert state.epoch == 0 and state.log == []
    state.epoch, state.log = 5, [1]
    state.commit()
    state.epoch = 9
    state.log.append(2)                             # an in-place change, after the commit
    state.restore()
    assert (state.epoch, state.log) == (5, [1])


def test_torch_state_restore_is_bitwise() -> None:
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvdt.elastic.TorchState(model, optimizer, batch=0)
    state.sync()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state.batch = 1
    state.commit()
    saved = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    optimizer.step()
    state.batch = 2
    state.restore()
    assert state.batch == 1 and state.model is model
    for p, s, m in zip(model.parameters(), saved, momentum):
        assert torch.equal(p, s) and torch.equal(optimizer.state[p]["momentum_buffer"], m)
    everyone = hvd.allgather_object([p.detach().numpy().tobytes() for p in saved])
    assert all(view == everyone[0] for view in everyone)     # sync made them equal


def test_run_restores_and_retries_a_failed_collective_while_the_world_is_whole() -> None:
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0)
    calls, resets = [], []
    state.register_reset_callbacks([lambda: resets.append(1)])

    @hvd.elastic.run
    def work(state: hvd.elastic.ObjectState) -> int:
        calls.append(state.step)
        state.step = 1
        state.commit()
        state.step = 2                              # lost by the restore below
        if len(calls) == 1:
            raise hvd.HorovodInternalError("simulated collective failure")
        return state.step

    assert work(state) == 2
    assert calls == [0, 1] and resets == [1]
    assert hvd.allreduce(np.ones(1), op=hvd.Sum, name="elastic.after.retry")[0] == hvd.size()


def test_hosts_updated_resets_without_restore() -> None:
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0)
    calls = []

    @hvd.elastic.run
    def work(state: hvd.elastic.ObjectState) -> None:
        calls.append(state.step)
        state.step += 1
        if hvd.rank() == 0 and len(calls) == 1:
            state.on_hosts_updated(7)               # only rank 0 hears of it
        state.check_host_updates()                  # every rank raises, in agreement

    work(state)
    assert calls == [0, 1]


def test_preemption_on_one_rank_stops_every_rank_after_writing(elastic_dir: str) -> None:
    reconfigure(elastic_persist_every=100)          # commits stay in memory...
    try:
        state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0)
        state.sync()
        state.step = 3
        state.commit()
        assert persist.read(elastic_dir) is None
        state.step = 4
        if hvd.rank() == hvd.size() - 1:
            preemption.request()                    # the signal reached one rank only
        with pytest.raises(preemption.Preempted):   # ...but preemption writes the last
            state.check_host_updates()
    finally:
        preemption._requested.clear()
        reconfigure(elastic_persist_every=1)
    hvd.barrier()
    fresh = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0)
    assert fresh.load_persisted() == (hvd.rank() == 0)
    fresh.sync()
    assert fresh.step == 3                          # the last commit, not the later change


def test_commit_writes_atomically_and_a_crash_before_rename_keeps_the_last(
        elastic_dir: str) -> None:
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=1)
    state.commit()

    def crash() -> None:
        raise KeyboardInterrupt("simulated crash between fsync and rename")

    persist.before_rename = crash
    try:
        state.step = 2
        if hvd.rank() == 0:
            with pytest.raises(KeyboardInterrupt):
                state.commit()
        else:
            state.save()
    finally:
        persist.before_rename = persist._no_op
    if hvd.rank() == 0:
        entries, commits = persist.read(elastic_dir)
        assert commits == 1
        fresh = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0)
        fresh.load_entries(entries)
        fresh.restore()
        assert fresh.step == 1
        leftovers = [p.name for p in Path(elastic_dir).iterdir() if p.name.endswith(".tmp")]
        assert leftovers                            # the torn write is only a temporary file
    hvd.barrier()


def test_unpicklable_attribute_raises_at_commit_naming_it() -> None:
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0, extra=None)
    state.extra = threading.Lock()
    with pytest.raises(hvd.StateError, match="'extra'"):
        state.commit()
    assert isinstance(hvd.StateError("x"), hvd.HvdliteError)
    hvd.barrier()


def test_committed_file_of_another_state_is_refused(elastic_dir: str) -> None:
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0)
    state.commit()
    other = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0)
    with pytest.raises(hvd.StateError, match="missing: \\['epoch'\\]"):
        other.load_persisted()                      # rank 0 reads; every rank raises
    hvd.barrier()


def test_elastic_sampler_resumes_without_repeats_or_gaps() -> None:
    data = list(range(37))
    sampler = hvdt.elastic.ElasticSampler(data, shuffle=True, seed=5)
    sampler.set_epoch(2)
    first = list(sampler)[:3]                       # three batches of one sample per rank
    for batch in range(3):
        sampler.record_batch(batch, 1)
    done = hvd.allgather_object(first)
    resumed = hvdt.elastic.ElasticSampler(data, shuffle=True, seed=5)
    resumed.load_state_dict(hvd.broadcast_object(sampler.state_dict(), name="elastic.smp"))
    rest = hvd.allgather_object(list(resumed))
    seen = [i for part in done + rest for i in part]
    padding = len(seen) - len(data)
    assert sorted(set(seen)) == data                # nothing skipped
    assert 0 <= padding < hvd.size()                # repeats only to pad the last round
