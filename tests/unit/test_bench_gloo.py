"""The gloo baseline of the allreduce benchmark: it times gloo's own collectives,
leaves no process group behind, and says why when it cannot run."""
from __future__ import annotations

import sys

import pytest
from mpi4py import MPI

from bench import gloo

dist = pytest.importorskip("torch.distributed")


@pytest.mark.timeout(60)
def test_the_lone_op_is_timed_on_a_group_that_is_gone_afterwards() -> None:
    assert gloo.missing_reason() is None
    seconds = gloo.lone_op(MPI.COMM_SELF, repeats=3, idle_s=0.0)
    assert 0.0 < seconds < 1.0
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_many_small_times_two_hundred_and_one_and_sums_in_place() -> None:
    many, one = gloo.many_small(MPI.COMM_SELF, seconds=0.01)
    assert many > 0.0 and one > 0.0
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_the_group_is_destroyed_when_the_timed_code_raises() -> None:
    with pytest.raises(ZeroDivisionError):
        with gloo.gloo_group(MPI.COMM_SELF) as group:
            assert group.get_world_size() == 1
            1 / 0
    assert not dist.is_initialized()


def test_without_torch_the_reason_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed", None)   # import raises ImportError
    reason = gloo.missing_reason()
    assert reason is not None and reason.startswith("torch is not installed")
