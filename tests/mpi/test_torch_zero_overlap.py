"""ZeroRedundancyOptimizer's reduce-scatters started in backward (hvdlite/torch/
zero/overlap.py), on lanes: last chunk first while backward still runs, and what
backward cannot know handled at the step: gradients changed in place or set by hand
after backward, a layer one rank did not use, accumulation. Each against the
negotiated path (HVDLITE_LANE=0), which reduces at the step."""
from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.api import runtime  # noqa: E402
from hvdlite.api.control import reconfigure  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere, handed  # noqa: E402

pytestmark = pytest.mark.timeout(120)
ROWS = 4


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.first = torch.nn.Linear(6, 9).double()
        self.spare = torch.nn.Linear(9, 9).double()      # used where the test says
        self.last = torch.nn.Linear(9, 4).double()
        self.seen: list[int] = []       # lane submissions when the first layer's turn came

    def forward(self, x: "torch.Tensor", use_spare: bool = True) -> "torch.Tensor":
        hidden = torch.tanh(self.first(x))
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: self.seen.append(len(_SUBMITTED[0])) or grad)
        if use_spare:
            hidden = torch.tanh(self.spare(hidden))
        return self.last(hidden)


_SUBMITTED: list[list[str]] = [[]]    # the lane submissions the hook counts


def _train(lane: bool, steps: int = 4,
           between: Callable[["torch.nn.Module", int], None] = lambda model, step: None,
           use_spare: Callable[[int], bool] = lambda step: True,
           passes: int = 1) -> tuple["torch.nn.Module", Any]:
    previous = runtime.config().lane, runtime.config().bucket_bytes
    reconfigure(lane=lane, bucket_bytes=40)
    try:
        model = _Net()
        optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        for step in range(steps):
            optimizer.zero_grad()
            for extra in range(passes):
                generator = torch.Generator().manual_seed(100 * step + 10 * extra + hvd.rank())
                x = torch.randn(ROWS, 6, generator=generator, dtype=torch.float64)
                model(x, use_spare(step)).pow(2).mean().backward()
            between(model, step)
            optimizer.step()
    finally:
        reconfigure(lane=previous[0], bucket_bytes=previous[1])
    return model, optimizer


def _same(train: Callable[[bool], tuple["torch.nn.Module", Any]]) -> None:
    """On lanes (reduced in backward) and negotiated (at the step): the same parameters
    within 1e-12, bitwise alike on every rank."""
    on_lanes, negotiated = train(True)[0], train(False)[0]
    for a, b in zip(on_lanes.parameters(), negotiated.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-12)
    assert_identical_everywhere([p.detach() for p in on_lanes.parameters()])


def _needs_lanes(optimizer: Any) -> None:
    if not optimizer._lanes:
        pytest.skip("no lanes of these kinds (HVDLITE_LANE=0, or a Gloo group's lane): "
                    "the chunks are negotiated at the step")


def test_backward_starts_the_reduce_scatters_last_chunk_first() -> None:
    model, optimizer = _train(True, steps=1)
    _needs_lanes(optimizer)
    chunks = len(optimizer._spaces[0].chunks)
    model.seen.clear()
    with handed() as (_, negotiated, on_lanes):
        generator = torch.Generator().manual_seed(hvd.rank())
        x = torch.randn(ROWS, 6, generator=generator, dtype=torch.float64)
        _SUBMITTED[0] = on_lanes
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        in_backward = list(on_lanes)
        optimizer.step()
    assert negotiated == []
    assert [int(name.rsplit(".", 1)[1]) for name in in_backward] == list(range(chunks))[::-1]
    # When the first layer's gradient came, the chunks of the later layers had gone.
    assert 0 < model.seen[0] < chunks, (model.seen, chunks)


def test_gradients_changed_in_place_after_backward_are_reduced_again() -> None:
    def halve(model: "torch.nn.Module", step: int) -> None:
        for param in model.parameters():
            param.grad.mul_(0.5)
    _same(lambda lane: _train(lane, between=halve))


def test_gradients_set_by_hand_after_backward_are_reduced_again() -> None:
    def replace(model: "torch.nn.Module", step: int) -> None:
        model.last.bias.grad = torch.full_like(model.last.bias, 0.1 * (hvd.rank() + 1))
    _same(lambda lane: _train(lane, between=replace))


def test_a_layer_one_rank_did_not_use_is_averaged_with_its_zeros() -> None:
    _same(lambda lane: _train(lane, use_spare=lambda step: hvd.rank() != 0 or step % 2 == 0))


def test_accumulated_passes_reduce_the_sum_of_their_gradients() -> None:
    _same(lambda lane: _train(lane, passes=3))
