"""A model wrapped again: fine-tuning in two phases, the head alone with one optimizer,
then every layer with a new one (another class, another learning rate), as the
tutorials do. The first wrapper's gradient hooks stay on the parameters for as long as
the model lives; they must stand aside for the newest wrapper, and the first wrapper
must be freed with its lanes. Either wrapper may be DistributedOptimizer or
ZeroRedundancyOptimizer. N ranks on 1/N of each batch reach one process's parameters
on the whole batch (float64, within TOLERANCE), bitwise alike on every rank."""
from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from tests.mpi.test_lane_close import _lanes_now, _until_every_rank  # noqa: E402
from tests.mpi.test_torch_training import (TOLERANCE,  # noqa: E402
                                           _assert_identical_everywhere, _batch, _model,
                                           _shard)

pytestmark = pytest.mark.timeout(120)
PHASES = ((torch.optim.SGD, {"lr": 0.1, "momentum": 0.5}, 6),   # the head alone
          (torch.optim.Adam, {"lr": 0.01}, 6))                   # then every layer


def _wrap(kind: str, model: "torch.nn.Module", cls: type, options: dict) -> Any:
    if kind == "plain":
        return cls(model.parameters(), **options)
    if kind == "zero":
        return hvd.ZeroRedundancyOptimizer(model.parameters(), cls, **options)
    return hvd.DistributedOptimizer(cls(model.parameters(), **options),
                                    named_parameters=model.named_parameters())


def _fine_tune(kinds: tuple[str, str]) -> tuple["torch.nn.Module", list]:
    """The model, and a weak reference to each phase's optimizer."""
    model = _model()
    distributed = kinds[0] != "plain"
    model[0].requires_grad_(False)
    step, freed = 0, []
    for kind, (cls, options, steps) in zip(kinds, PHASES):
        optimizer = _wrap(kind, model, cls, options)
        for _ in range(steps):
            x, y = _batch(step)
            if distributed:
                x, y = _shard(x), _shard(y)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            step += 1
        freed.append(weakref.ref(optimizer))
        model[0].requires_grad_(True)
        del optimizer
    return model, freed


@pytest.mark.parametrize("kinds", [("distributed", "distributed"), ("distributed", "zero"),
                                   ("zero", "distributed"), ("zero", "zero")])
def test_a_model_wrapped_again_trains_as_one_process_and_frees_the_first(
        kinds: tuple[str, str]) -> None:
    before = _lanes_now()
    model, freed = _fine_tune(kinds)
    reference, _ = _fine_tune(("plain", "plain"))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=TOLERANCE), (name, float((p - q).abs().max()))
    _assert_identical_everywhere(model)
    gc.collect()
    assert [ref() is None for ref in freed] == [True, True]
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    _until_every_rank(before)
