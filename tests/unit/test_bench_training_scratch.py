"""``python -m bench training --report-cost`` writes its reports to a
temporary directory that exists while the launches run and is gone after: nothing
is left in ``$TMPDIR``. No benchmark runs here:
the launches are stood in for."""
from __future__ import annotations

import os
from typing import Any

import pytest

from bench import training


def test_report_directory_exists_during_the_launches_and_is_removed_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, bool]] = []

    def launches(methods: list, np_: int, rounds: int, metric: str, progress: str) -> Any:
        for method in methods:
            for name, value in method.env:
                if name == "HVDLITE_REPORT":
                    seen.append((value, os.path.isdir(value)))
        return {}

    monkeypatch.setattr(training.launches, "interleaved", launches)
    monkeypatch.setattr(training, "_print_table", lambda *table: None)
    training.main(["--np", "1", "--models", training.MODELS[0], "--report-cost"])
    assert seen and all(existed for _, existed in seen)
    assert not any(os.path.exists(path) for path, _ in seen)
