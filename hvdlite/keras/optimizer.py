"""``hvdlite.keras.DistributedOptimizer``, ``PartialDistributedOptimizer`` and
``load_model``: the Keras code hvdlite.tensorflow shares (``hvdlite._keras.optimizer``),
on this Keras backend's binding (``hvdlite.keras.backend.SUPPORT``)."""
from __future__ import annotations

import functools
from typing import Any, Callable

from hvdlite._keras import optimizer as _shared
from hvdlite._keras.optimizer import Settings, _Distributed, _warned_xla  # noqa: F401
from hvdlite.keras.backend import SUPPORT


def _on_this_backend(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def bound(*args: Any, **kwargs: Any) -> Any:
        return function(*args, support=SUPPORT, **kwargs)
    return bound


DistributedOptimizer = _on_this_backend(_shared.DistributedOptimizer)
PartialDistributedOptimizer = _on_this_backend(_shared.PartialDistributedOptimizer)
load_model = _on_this_backend(_shared.load_model)
