"""``python -m bench local-sgd``: one launch per way of training, a line of results each,
and the curves' moving mean. No example runs here: the launches are stood in for."""
from __future__ import annotations

from typing import Any

import pytest

from bench import local_sgd


def test_the_moving_mean_averages_each_value_with_those_before_it() -> None:
    assert local_sgd.smoothed([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert local_sgd.smoothed([2.0], window=10) == [2.0]
    assert local_sgd.smoothed([], window=3) == []


def test_each_period_and_the_distributed_optimizer_run_once_and_report(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    launched: list[tuple[int, int, int]] = []

    def run(np_: int, period: int, epochs: int, losses: str) -> tuple[list[float], Any]:
        launched.append((np_, period, epochs))
        return [2.0] * 5 + [0.5] * 10, "4 ranks, 3 epochs in 1.0 s: test accuracy 0.9750"

    monkeypatch.setattr(local_sgd, "run", run)
    local_sgd.main(["--np", "4", "--epochs", "3", "--periods", "2", "8"])
    assert launched == [(4, 0, 3), (4, 2, 3), (4, 8, 3)]
    out = capsys.readouterr().out
    assert "DistributedOptimizer: 15 steps, final loss 0.5000" in out
    assert "local SGD, period 8: 15 steps, final loss 0.5000 (mean of the last 10), test " \
           "accuracy 0.9750" in out
