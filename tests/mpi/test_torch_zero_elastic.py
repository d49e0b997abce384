"""A ZeroRedundancyOptimizer in the elastic TorchState: a commit gathers its state to
rank 0, a restore (in memory on every rank, or from HVDLITE_ELASTIC_DIR on rank 0
alone) and the sync after it give each rank its share back, and training then goes
on bitwise as it would have without the detour, on every rank. Resuming at another
world size: tests/integration/test_zero_elastic.py."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere  # noqa: E402
from tests.mpi.test_torch_zero import _Model, _train  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _zero(model: "torch.nn.Module") -> "hvd.ZeroRedundancyOptimizer":
    return hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01,
                                       weight_decay=0.1)


def _uninterrupted(steps: int) -> "torch.nn.Module":
    model = _Model()
    _train(model, _zero(model), range(steps), hvd.rank(), hvd.size())
    return model


def _assert_bitwise(model: "torch.nn.Module", twin: "torch.nn.Module") -> None:
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), (name, (p - q).abs().max())
    assert_identical_everywhere([p.detach().numpy() for p in model.parameters()])


def test_a_restored_commit_goes_on_bitwise_as_without_the_detour(small_chunks: None) -> None:
    model = _Model()
    optimizer = _zero(model)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    state.sync()                                   # as hvd.elastic.run starts
    _train(model, optimizer, range(3), hvd.rank(), hvd.size())
    state.step = 3
    state.commit()
    _train(model, optimizer, range(100, 102), hvd.rank(), hvd.size())   # undone below
    state.restore()
    state.sync()
    assert state.step == 3 and state.optimizer is optimizer
    _train(model, optimizer, range(3, 6), hvd.rank(), hvd.size())
    _assert_bitwise(model, _uninterrupted(6))


def test_a_commit_resumed_from_the_directory_goes_on_bitwise(small_chunks: None,
                                                             elastic_dir: str) -> None:
    """Rank 0 alone reads the file and restores; sync() hands every rank its share."""
    model = _Model()
    optimizer = _zero(model)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    state.sync()
    _train(model, optimizer, range(4), hvd.rank(), hvd.size())
    state.step = 4
    state.commit()                                 # written to HVDLITE_ELASTIC_DIR
    fresh = _Model()
    resumed_optimizer = _zero(fresh)
    resumed = hvd.elastic.TorchState(model=fresh, optimizer=resumed_optimizer, step=0)
    assert resumed.load_persisted() == (hvd.rank() == 0)
    resumed.sync()
    assert resumed.step == 4
    assert any(resumed_optimizer.local_optimizer.state.values())   # its share is back
    _train(fresh, resumed_optimizer, range(4, 7), hvd.rank(), hvd.size())
    _assert_bitwise(fresh, _uninterrupted(7))


def test_a_zero_over_a_smaller_set_is_refused_by_torch_state() -> None:
    if hvd.size() < 2:
        pytest.skip("every set of one rank is the world")
    fewer = hvd.add_process_set(list(range(hvd.size() - 1)))
    try:
        if fewer.included():
            model = _Model()
            optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD,
                                                    process_set=fewer, lr=0.1)
            with pytest.raises(hvd.UsageError, match="over every rank only"):
                hvd.elastic.TorchState(model=model, optimizer=optimizer)
    finally:
        hvd.remove_process_set(fewer)
