"""ZeroRedundancyOptimizer on lanes (hvdlite/torch/zero/lanes.py): after the first step
nothing is negotiated, training matches the negotiated path (HVDLITE_LANE=0), and what
a round would have caught is still an error on every rank: a rank whose own step
raised, and a rank that joined while the others step. The lanes' collectives against
NumPy, with awkward sizes, are tests/unit/test_lane_shards.py's."""
from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.api import runtime  # noqa: E402
from hvdlite.api.control import reconfigure  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere, handed  # noqa: E402

pytestmark = pytest.mark.timeout(120)
ROWS = 4


def _model() -> "torch.nn.Module":
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(),
                               torch.nn.Linear(13, 5)).double()


def _backward(model: "torch.nn.Module", step: int) -> None:
    generator = torch.Generator().manual_seed(100 * step + hvd.rank())
    x = torch.randn(ROWS, 7, generator=generator, dtype=torch.float64)
    model(x).pow(2).mean().backward()


def _zero(model: "torch.nn.Module", kind: type = torch.optim.Adam) -> Any:
    return hvd.ZeroRedundancyOptimizer(model.parameters(), kind, lr=0.01)


def _on_lanes(optimizer: Any) -> bool:
    return bool(optimizer._lanes)


def test_a_step_on_lanes_negotiates_nothing(lane: bool, small_chunks: None) -> None:
    model = _model()
    optimizer = _zero(model)
    for step in range(3):
        with handed() as (_, negotiated, on_lanes):
            optimizer.zero_grad()
            _backward(model, step)
            optimizer.step()
        if not _on_lanes(optimizer):
            assert any(name.endswith(".gradients") for name in negotiated), negotiated
            continue
        assert negotiated == [], negotiated
        chunks = len(optimizer._spaces[0].chunks)
        assert [n.split(".")[-3] for n in on_lanes] == ["grads"] * chunks + ["params"] * chunks
    assert _on_lanes(optimizer) == lane     # every transport's lanes: MPI's, shared memory, Gloo
    assert_identical_everywhere([p.detach() for p in model.parameters()])


@pytest.mark.parametrize("chunk_bytes", [40, 1 << 20], ids=["chunks", "one-chunk"])
def test_lanes_train_as_the_negotiated_path(chunk_bytes: int) -> None:
    """float64, Adam, 6 steps, a frozen bias from the third, in chunks of 5 elements
    (each rank's run of every chunk even, at most 3) or one: the same parameters within
    1e-12 (the sums' order may differ), bitwise alike on every rank."""
    results = []
    for on in (True, False):
        previous = runtime.config().lane, runtime.config().bucket_bytes
        reconfigure(lane=on, bucket_bytes=chunk_bytes)
        try:
            model = _model()
            optimizer = _zero(model)
            assert len(optimizer._spaces[0].chunks) > 1 or chunk_bytes > 40
            for step in range(6):
                model[2].bias.requires_grad_(step < 2)
                optimizer.zero_grad()
                _backward(model, step)
                optimizer.step()
        finally:
            reconfigure(lane=previous[0], bucket_bytes=previous[1])
        params = [p.detach().clone() for p in model.parameters()]
        assert_identical_everywhere(params)
        results.append(params)
    for on_lanes, negotiated in zip(*results):
        torch.testing.assert_close(on_lanes, negotiated, rtol=0, atol=1e-12)


class _FailsOnLastRank(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        if hvd.rank() == hvd.size() - 1 and getattr(self, "fail", False):
            raise RuntimeError("this rank's optimizer failed")
        return super().step(closure)


def test_a_rank_whose_step_raises_fails_every_rank_and_the_next_step_goes_on() -> None:
    model = _model()
    optimizer = _zero(model, _FailsOnLastRank)
    if not _on_lanes(optimizer):
        pytest.skip("negotiated chunks: the others wait in the allgather (a deadlock "
                    "error, tests/mpi/test_deadlock.py's)")
    last = hvd.size() - 1
    optimizer.local_optimizer.fail = True
    _backward(model, 0)
    with pytest.raises(Exception) as caught:
        optimizer.step()
    if hvd.rank() == last:
        assert isinstance(caught.value, RuntimeError), caught.value
    else:
        assert isinstance(caught.value, hvd.UsageError), caught.value
        assert f"rank {last}'s step failed, so '" in str(caught.value)
    optimizer.local_optimizer.fail = False
    optimizer.zero_grad()
    _backward(model, 1)
    optimizer.step()                     # the lanes still pair up


def test_a_rank_that_joined_fails_the_others_step_clearly() -> None:
    if hvd.size() < 2:
        pytest.skip("needs a rank to join while the others step")
    model = _model()
    optimizer = _zero(model)
    if not _on_lanes(optimizer):
        pytest.skip("negotiated chunks: a joined rank's part is Horovod's join's")
    last = hvd.size() - 1
    if hvd.rank() != last:
        _backward(model, 0)
        with pytest.raises(hvd.UsageError, match=r"1 rank\(s\) joined \(hvd.join\) while "
                                                  r"the others exchanged"):
            optimizer.step()
    hvd.join()
    optimizer.zero_grad()
    _backward(model, 1)
    optimizer.step()                     # after the join, every rank steps alike
    assert_identical_everywhere([p.detach() for p in model.parameters()])


class _Held:
    """A lane collective that reports itself done only once ``released`` is set."""

    def __init__(self, pending: Any, released: threading.Event) -> None:
        self._pending, self._released = pending, released

    def Test(self) -> bool:  # noqa: N802 (the Pending protocol's name)
        return self._released.is_set() and self._pending.Test()


def test_a_rank_that_shuts_down_after_its_last_step_leaves_the_others_to_finish() -> None:
    """Rank 0 steps and shuts down at once, as a script that ends after its last
    step does at exit. The others' engines see their last allgather done only once
    that shutdown has reached them (held here, so that the order is certain): they
    finish it, every rank's step returns, and the parameters are alike."""
    if hvd.size() < 2:
        pytest.skip("needs a peer")
    model = _model()
    optimizer = _zero(model)
    engine, released = runtime.engine(), threading.Event()
    if hvd.rank() != 0:
        lane_id = optimizer._lanes[0]._params.lane_id
        channel = engine.lanes._lanes[lane_id].channel
        start = channel.start_allgather
        channel.start_allgather = lambda *args: _Held(start(*args), released)
        finish = engine._finish_lanes

        def shutdown_reached(counts: Any) -> None:
            released.set()
            finish(counts)
        engine._finish_lanes = shutdown_reached
    _backward(model, 0)
    error = None
    try:
        optimizer.step()
    except hvd.HvdliteError as caught:      # a ShutdownError, were it not finished
        error = caught
    finally:
        hvd.shutdown()
        hvd.init()
    assert_identical_everywhere([p.detach() for p in model.parameters()])
    assert error is None, error
