"""``check_count``: the one check of a whole number of steps or batches (local SGD's period
and warm-up, the Keras averaging and commit callbacks)."""
from __future__ import annotations

from typing import Any

import pytest

from hvdlite.api.submission import check_count
from hvdlite.errors import UsageError


@pytest.mark.parametrize("value,least", [(1, 1), (0, 0), (7, 1)])
def test_a_whole_number_at_or_above_the_least_is_returned(value: int, least: int) -> None:
    assert check_count(value, "period", least) == value


@pytest.mark.parametrize("value,least", [(0, 1), (-1, 0), (True, 0), (2.0, 1), ("3", 1), (None, 0)])
def test_anything_else_names_the_setting_the_least_and_the_value(value: Any, least: int) -> None:
    with pytest.raises(UsageError, match=rf"^period must be an int of at least {least}, "
                                         rf"not {repr(value)}$"):
        check_count(value, "period", least)
