"""init()'s agreement on the backend registry (hvdlite.backends.registry.agree), on the
in-process transport: ranks whose tables differ fail on every rank, with one message
that names the ranks, the backends and the fix; equal tables pass."""
from __future__ import annotations

from typing import Any

import pytest

from hvdlite.backends import registry
from hvdlite.errors import BackendRegistryMismatchError, MismatchError
from tests.unit.fake_transport import ThreadTransport, run_transports

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("device_registry")]

TOY = ("toy", ("cpu",))


def _agree_with(tables: dict[int, Any]) -> Any:
    """Each rank's outcome: None, or the error it raised."""
    def step(t: ThreadTransport) -> Any:
        try:
            registry.agree(t, tables.get(t.rank, registry.described()))
        except BackendRegistryMismatchError as error:
            return error
        return None
    return step


@pytest.mark.parametrize("size", [1, 2, 4])
def test_equal_tables_agree(size: int) -> None:
    assert run_transports(size, _agree_with({})) == [None] * size


@pytest.mark.parametrize("size", [2, 4])
def test_a_backend_registered_on_some_ranks_fails_every_rank(size: int) -> None:
    base = registry.described()
    odd = {r: (TOY,) + base for r in range(1, size, 2)}
    errors = run_transports(size, _agree_with(odd))
    assert all(isinstance(e, MismatchError) for e in errors), errors
    texts = {str(e).split(": ", 1)[1] for e in errors}
    assert len(texts) == 1                                      # one message, every rank
    for rank, error in enumerate(errors):
        assert str(error).startswith(f"rank {rank}: ")
        assert error.ranks == list(odd) and error.backends == ["toy"]
    text = texts.pop()
    assert "rank 1 also has ['toy']" in text and "before hvdlite.init()" in text


def test_order_and_devices_count_too() -> None:
    base = registry.described()
    swapped = (base[1], base[0]) + base[2:]
    errors = run_transports(3, _agree_with({1: swapped, 2: (("toy", None),) + base,
                                            0: (TOY,) + base}))
    text = str(errors[0])
    assert "rank 1 lacks ['toy']" in text and "rank 2 serves every device with 'toy'" in text
    assert errors[0].ranks == [1, 2]
    only_order = run_transports(2, _agree_with({1: swapped}))
    assert "has them in another order" in str(only_order[0])
