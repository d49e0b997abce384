"""ZeroRedundancyOptimizer.clip_grad_norm_: the averaged gradients clipped by their total
norm, as torch.nn.utils.clip_grad_norm_ clips them after DistributedOptimizer's
synchronize() (Horovod's idiom), for norms of order 2, 1 and inf, with the clip biting
and not; float64, within 1e-10 over 8 AdamW steps, every rank bitwise alike. A new
backward after a clip makes step() reduce again; Horovod's synchronize() is refused."""
from __future__ import annotations

import math
from typing import Any, Optional

import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere  # noqa: E402

pytestmark = pytest.mark.timeout(180)
ROWS = 12


def _model() -> "torch.nn.Module":
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(7, 19), torch.nn.Tanh(),
                               torch.nn.Linear(19, 3)).double()


def _loss(model: "torch.nn.Module", step: int) -> "torch.Tensor":
    generator = torch.Generator().manual_seed(40 + step)
    x = torch.randn(ROWS, 7, generator=generator, dtype=torch.float64)
    y = torch.randn(ROWS, 3, generator=generator, dtype=torch.float64) * 5
    per = ROWS // hvd.size()
    rows = slice(hvd.rank() * per, (hvd.rank() + 1) * per)
    return torch.nn.functional.mse_loss(model(x[rows]), y[rows])


def _zero_run(steps: int, max_norm: float, norm_type: float) -> tuple[Any, list[float]]:
    model = _model()
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, step).backward()
        norms.append(optimizer.clip_grad_norm_(max_norm, norm_type).item())
        optimizer.step()
    return model, norms


def _horovod_run(steps: int, max_norm: Optional[float], norm_type: float) -> tuple[Any, list]:
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, step).backward()
        optimizer.synchronize()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
                                                    norm_type).item())
        with optimizer.skip_synchronize():
            optimizer.step()
    return model, norms


def _assert_close(model: Any, reference: Any) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-10), (name, (p - q).abs().max())
    assert_identical_everywhere([p.detach().numpy() for p in model.parameters()])


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf], ids=["l2", "l1", "inf"])
@pytest.mark.parametrize("max_norm", [0.05, 1e3], ids=["clipped", "not-clipped"])
def test_clipping_matches_distributed_optimizers(norm_type: float, max_norm: float) -> None:
    model, norms = _zero_run(8, max_norm, norm_type)
    reference, reference_norms = _horovod_run(8, max_norm, norm_type)
    assert norms == pytest.approx(reference_norms, rel=1e-12)
    if max_norm < 1:
        assert min(norms) > max_norm * 2, "the clip must bite in every step"
    assert len(set(map(tuple, hvd.allgather_object(norms)))) == 1
    _assert_close(model, reference)


def test_a_backward_after_the_clip_is_reduced_again_by_step() -> None:
    """Clip, then accumulate one more backward: step() reduces the new sum, unclipped,
    as if the clip had not happened."""
    clipped, plain = _model(), _model()
    runs = []
    for model in (clipped, plain):
        optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        runs.append(optimizer)
        _loss(model, 0).backward()
    runs[0].clip_grad_norm_(1e-3)
    for model, optimizer in zip((clipped, plain), runs):
        _loss(model, 1).backward()
        optimizer.step()
    _assert_close(clipped, plain)


def test_a_nonfinite_norm_is_an_error_on_every_rank_when_asked() -> None:
    model = _model()
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    loss = _loss(model, 0) * (math.inf if hvd.rank() == 0 else 1.0)
    loss.backward()
    with pytest.raises(hvd.UsageError, match="error_if_nonfinite"):
        optimizer.clip_grad_norm_(1.0, error_if_nonfinite=True)


def test_horovods_synchronize_is_refused_on_every_rank() -> None:
    model = _model()
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    _loss(model, 0).backward()
    with pytest.raises(hvd.NotSupportedError, match=r"clip_grad_norm_\(max_norm\)"):
        optimizer.synchronize()
    with pytest.raises(hvd.NotSupportedError, match="skip_synchronize"):
        with optimizer.skip_synchronize():
            pass
    optimizer.step()          # still usable: reduced and stepped as usual
