"""The engine at one rank (tests/unit/engine_rig.py): a rank in join() says so on its
other sets, whose rounds it makes full for that."""
from __future__ import annotations

import pytest

from hvdlite.negotiation.process_sets import NO_FULL_ROUND
from hvdlite.negotiation.requests import Descriptor, Kind, Request
from tests.unit.engine_rig import FullRounds, outcome, second_set, set_up

pytestmark = pytest.mark.timeout(60)


def test_a_rank_in_join_asks_for_full_rounds_on_other_sets_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = set_up()
    other = engine.registry.member(second_set(engine))
    assert engine._round_vector(other)[0] & NO_FULL_ROUND
    join = engine.submit(Request(Descriptor("join", Kind.JOIN), 0))
    engine._drain_queue()
    assert not engine._round_vector(other)[0] & NO_FULL_ROUND     # full, to say it
    rounds = FullRounds(engine, monkeypatch)
    assert engine._full_round(other)
    assert [set_id for set_id, _ in rounds.sent] == [other.set_id] and rounds.sent[0][1].joined
    engine._iteration()                                  # one rank: every rank has joined
    assert outcome(engine, join) == 0
    assert engine._round_vector(other)[0] & NO_FULL_ROUND

