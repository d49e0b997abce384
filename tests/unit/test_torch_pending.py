"""torch_work.TorchPending.wait_for over fake torch Work objects: a timed-out wait
is False (torch raises for it), an operation that ends as the wait times out is True,
and one that failed raises its own error."""
from __future__ import annotations

import datetime
from typing import Optional

import pytest

torch_work = pytest.importorskip("hvdlite.transport.torch_work")


class Work:
    """A torch Work: ``ends_after`` waits time out first; ``error`` is how it ends."""

    def __init__(self, ends_after: int = 0, error: Optional[Exception] = None,
                 ends_while_timing_out: bool = False) -> None:
        self.waits: list[Optional[datetime.timedelta]] = []
        self.ends_after, self.error = ends_after, error
        self.ends_while_timing_out = ends_while_timing_out
        self.completed = False

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        self.waits.append(timeout)
        if not self.completed and len(self.waits) <= self.ends_after:
            self.completed = self.ends_while_timing_out
            raise RuntimeError("Operation timed out!")
        self.completed = True
        if self.error is not None:
            raise self.error
        return True


def test_a_wait_that_times_out_is_false_then_true_once_the_work_ends() -> None:
    work = Work(ends_after=1)
    pending = torch_work.TorchPending(work)
    assert pending.wait_for(0.1) is False
    assert pending.wait_for(0.0004) is True
    # Whole milliseconds, at least 1: torch reads 0 as no limit at all.
    assert work.waits == [datetime.timedelta(milliseconds=100),
                          datetime.timedelta(milliseconds=1)]
    assert pending.wait_for(0.1) is True and len(work.waits) == 2   # done: no more waits
    assert pending.Test() is True


def test_a_work_that_ends_as_its_wait_times_out_is_complete() -> None:
    work = Work(ends_after=1, ends_while_timing_out=True)
    assert torch_work.TorchPending(work).wait_for(0.05) is True
    assert work.waits[1] is None              # looked at once more, without a limit


def test_a_failed_work_raises_its_own_error_from_wait_for() -> None:
    failure = RuntimeError("Connection closed by peer [127.0.0.1]:29500")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        torch_work.TorchPending(Work(error=failure)).wait_for(0.1)
    late = Work(ends_after=1, ends_while_timing_out=True, error=failure)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        torch_work.TorchPending(late).wait_for(0.1)
