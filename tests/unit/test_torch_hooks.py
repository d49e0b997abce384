"""Gradient hooks of the newest optimizer to claim a parameter (hvdlite/torch/hooks.py):
an older owner's hook stands aside, a freed owner's hooks are removed, and a freed
parameter's claim is forgotten."""
from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from hvdlite.torch import hooks  # noqa: E402


class _Owner:
    def __init__(self, params: list) -> None:
        self.calls: list[str] = []
        self.handles = [hooks.hook(p, self, _Owner.on_grad) for p in params]
        hooks.claim(params, self)
        hooks.remove_when_freed(self, self.handles)

    def on_grad(self, param: "torch.Tensor") -> None:
        self.calls.append(tuple(param.shape))


def _backward(param: "torch.Tensor") -> None:
    (param * 2).sum().backward()


def test_only_the_newest_owner_hears_a_gradient() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    first = _Owner([param])
    _backward(param)
    second = _Owner([param])
    _backward(param)
    assert first.calls == [(3,)] and second.calls == [(3,)]
    assert hooks.owns(param, second) and not hooks.owns(param, first)


def test_a_freed_owners_hooks_are_removed_and_nothing_holds_it() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    owner = _Owner([param])
    assert len(param._post_accumulate_grad_hooks) == 1
    del owner
    gc.collect()
    assert not param._post_accumulate_grad_hooks
    _backward(param)                      # no hook, no error


def test_a_freed_parameters_claim_is_forgotten() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    owner = _Owner([param])
    key = id(param)
    assert key in hooks._CLAIMS
    del param
    gc.collect()
    assert key not in hooks._CLAIMS
    assert owner.calls == []
