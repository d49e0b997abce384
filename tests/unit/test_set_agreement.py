"""init(process_sets=...): every rank decides from the same gathered requests, so all
register the same sets or all raise the same UsageError (a ValueError), and nothing
is registered before they agree; at engine set-up the agreed sets follow the global one."""
from __future__ import annotations

import re

import pytest
from mpi4py import MPI

from hvdlite.config import Config
from hvdlite.engine.engine import Engine
from hvdlite.errors import UsageError
from hvdlite.negotiation.set_agreement import agree_on_sets
from hvdlite.transport.mpi_transport import MpiTransport
from tests.unit.engine_rig import QUIET, SafeComm


def test_sets_every_rank_asked_for_are_agreed_in_order() -> None:
    asked = [(0,), (1, 2, 3), (2, 3)]
    assert agree_on_sets([asked] * 4, 4, {}, 0) == asked


@pytest.mark.parametrize("sets,what", [
    ([(0,), (1, 2, 3), (0, 1, 2, 3)], "entry 2, ranks [0, 1, 2, 3], duplicates the global"),
    ([(0,), (1, 2, 3), (0,)], "entry 2, ranks [0], duplicates entry 0"),
    ([(0,), (1, 4)], "entry 1, ranks [1, 4], names ranks outside 0..3"),
])
def test_a_refused_list_is_the_same_error_on_every_rank(sets: list, what: str) -> None:
    messages = set()
    for me in range(4):
        expected = re.escape(f"hvdlite.init(process_sets=...): {what}")
        with pytest.raises(ValueError, match=expected) as info:
            agree_on_sets([sets] * 4, 4, {}, me)
        assert isinstance(info.value, UsageError) and f"rank {me}:" in str(info.value)
        messages.add(str(info.value).replace(f"rank {me}:", "", 1))
    assert len(messages) == 1


def test_a_set_registered_before_is_a_duplicate_naming_its_id() -> None:
    with pytest.raises(UsageError, match=r"ranks \[1\], duplicates process set 3, already"):
        agree_on_sets([[(1,)]] * 2, 2, {0: (0, 1), 3: (1,)}, 1)


def test_lists_that_differ_between_ranks_name_the_ranks() -> None:
    asked = [[(0,)], [(0,)], [(1,)], [(0,)]]
    with pytest.raises(UsageError, match=r"rank 0 asked for \[\[0\]\], rank 2 for \[\[1\]\] "
                                         r"\(ranks that differ from rank 0: \[2\]\)"):
        agree_on_sets(asked, 4, {}, 3)


def test_one_ranks_bad_argument_is_reported_on_every_rank() -> None:
    asked = [[(0,)], "entry 0 is a list, not a ProcessSet"]
    for me in range(2):
        with pytest.raises(UsageError, match="refused on some ranks: rank 1: entry 0 is a list"):
            agree_on_sets(asked, 2, {}, me)


def test_engine_set_up_registers_the_agreed_sets_after_the_global_one() -> None:
    """At one rank the only set is the global one: asking for (0,) again is refused
    before anything is registered; asking for nothing registers the global set."""
    engine = Engine(Config(**QUIET), MpiTransport(SafeComm(MPI.COMM_SELF.Dup())), [(0,)])
    with pytest.raises(UsageError, match="duplicates the global process set"):
        engine._setup()
    assert engine.registry.registered() == {}
    engine = Engine(Config(**QUIET), MpiTransport(SafeComm(MPI.COMM_SELF.Dup())), [])
    engine._setup()
    assert engine.registry.registered() == {0: (0,)}
