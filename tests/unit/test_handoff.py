"""hvdlite/transport/handoff.py: tensors handed to Gloo's threads are held until Gloo has
let go of them, and the exit hook waits for that before the interpreter finalizes
(a Gloo thread that releases the last reference during finalization aborts the
process: 'terminate called without an active exception')."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest

from hvdlite.transport import handoff
from hvdlite.transport.handoff import Handoff


class Tensor:
    """A tensor's Python object, which torch refers to while Gloo holds the tensor."""


class Gloo:
    """What Gloo's thread holds: the tensors of operations it has not let go of."""

    def __init__(self, *tensors: Tensor) -> None:
        self.held = list(tensors)

    def let_go(self, once: Optional[threading.Event] = None) -> threading.Thread:
        """Let go now, or once ``once`` is set (giving up after a minute)."""
        def later() -> None:
            if once is not None:
                once.wait(60)
            self.held.clear()
        thread = threading.Thread(target=later, daemon=True)
        thread.start()
        return thread


def asleep(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once the handoff's wait first sleeps: it is waiting for Gloo by then."""
    sleeping = threading.Event()

    def sleep(seconds: float) -> None:
        sleeping.set()
        time.sleep(seconds)
    monkeypatch.setattr(handoff, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    return sleeping


def test_a_tensor_is_held_until_gloo_lets_go_of_it() -> None:
    book = Handoff()
    gloo = Gloo(Tensor(), Tensor())
    book.hold(gloo.held)
    assert book.alive() == 2
    gloo.held.pop()
    assert book.alive() == 1
    gloo.let_go().join()
    assert book.alive() == 0


def test_hold_lets_go_of_those_released_first() -> None:
    book = Handoff()
    book.hold([Tensor()])                         # nobody else holds it: released
    gloo = Gloo(Tensor())
    book.hold(gloo.held)
    assert book._held == gloo.held


def test_await_released_returns_once_gloo_lets_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gloo lets go only once the wait sleeps, so the wait cannot end before it."""
    book = Handoff()
    gloo = Gloo(Tensor())
    book.hold(gloo.held)
    thread = gloo.let_go(once=asleep(monkeypatch))
    assert book.await_released(60.0) is True and gloo.held == []
    thread.join()


def test_await_released_gives_up_after_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fake clock that only its sleeps move: it gives up at its timeout, not before."""
    now = [100.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds
    monkeypatch.setattr(handoff, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    book = Handoff()
    gloo = Gloo(Tensor())
    book.hold(gloo.held)
    assert book.await_released(0.05) is False
    assert 100.05 <= now[0] < 100.05 + 2 * handoff._PAUSE_S


def test_the_held_list_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "_MOST", 3)
    book = Handoff()
    gloo = Gloo(*[Tensor() for _ in range(6)])
    for tensor in gloo.held:
        book.hold([tensor])
    assert book.alive() == 3 and book._held == gloo.held[-3:]


def test_a_real_gloo_operation_is_let_go_of(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own Work: while it lives it holds the tensor; once it is gone, nothing."""
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    from hvdlite.transport import torch_work
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    book = Handoff()
    monkeypatch.setattr(torch_work, "HANDOFF", book)
    out = np.zeros(5, dtype=np.float32)
    tensor = torch.from_numpy(out)
    pending = torch_work.TorchPending(group.allreduce([tensor]), tensor)
    work = pending._work
    del tensor
    pending.wait()
    assert book.alive() == 1                      # the Work, alive here, holds it
    del work, pending
    assert book.await_released(5.0) is True       # Gloo let go: only the handoff holds it


def test_the_exit_hook_waits_for_gloo_to_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch.distributed")
    from hvdlite.transport import torch_transport
    book = Handoff()
    monkeypatch.setattr(torch_transport, "HANDOFF", book)
    monkeypatch.setattr(torch_transport.dist, "is_initialized", lambda: False)
    gloo = Gloo(Tensor())
    book.hold(gloo.held)
    thread = gloo.let_go(once=asleep(monkeypatch))      # only while the hook waits
    torch_transport._at_exit()
    assert book.alive() == 0
    thread.join()


def test_the_exit_hook_is_registered_once_whoever_made_the_groups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that made its own default group (hvdlite uses it as it is, and leaves
    its teardown to the program) still hands tensors to Gloo's threads."""
    pytest.importorskip("torch.distributed")
    from hvdlite.transport import torch_transport
    registered: list[Any] = []
    monkeypatch.setattr(torch_transport.atexit, "register", registered.append)
    monkeypatch.setattr(torch_transport.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch_transport, "_exit_hook",
                        {"registered": False, "destroys_world": False})
    torch_transport.initialize()
    torch_transport.initialize()                  # a second init() in the process
    assert registered == [torch_transport._at_exit]
    assert torch_transport._exit_hook["destroys_world"] is False    # the program's own


def test_a_completed_operation_keeps_its_tensors_no_longer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch.distributed")
    from hvdlite.transport import torch_work
    book = Handoff()
    monkeypatch.setattr(torch_work, "HANDOFF", book)

    class Work:
        def is_completed(self) -> bool:
            return True

        def wait(self, timeout: Any = None) -> bool:
            return True
    gloo = Gloo(Tensor())
    pending = torch_work.TorchPending(Work(), *gloo.held)
    assert pending.Test() is True
    assert pending._keep == () and book._held == gloo.held


# -- torch_nccl.py's device groups (Gloo's in the CPU stand-in, NCCL's on GPUs) ------------

class Group:
    """A device group that records the tensors each collective is given, as torch's
    threads would hold them."""

    def __init__(self) -> None:
        self.given: list[Any] = []

    def allreduce(self, tensors: list[Any], options: Any) -> None:
        self.given.extend(tensors)

    def _allgather_base(self, out: Any, inp: Any, options: Any) -> None:
        self.given.extend((out, inp))


@pytest.fixture
def torch_nccl(monkeypatch: pytest.MonkeyPatch) -> Any:
    """torch_nccl.py under the fake CuPy, its stream a no-op and its HANDOFF a fresh one."""
    import contextlib
    from types import SimpleNamespace

    from tests.unit import gpu_ranks
    module = gpu_ranks.loader(monkeypatch)().torch_nccl
    monkeypatch.setattr(module, "DEVICE", SimpleNamespace(on_engine_stream=contextlib.nullcontext))
    monkeypatch.setattr(module, "HANDOFF", Handoff())
    return module


def test_a_device_groups_collective_hands_its_tensors_to_the_handoff(torch_nccl: Any) -> None:
    group, tensor = Group(), Tensor()
    torch_nccl.TorchNcclBackend._run(lambda t: group.allreduce([t], None), tensor)
    assert group.given == [tensor] and torch_nccl.HANDOFF._held == [tensor]


@pytest.mark.parametrize("counts", [[3, 3], [2, 3]], ids=["even", "padded"])
def test_an_allgather_on_a_device_group_hands_what_it_gave_to_the_handoff(
        torch_nccl: Any, counts: list[int]) -> None:
    import torch
    me = counts.index(max(counts))
    send, recv = torch.ones(counts[me]), torch.zeros(sum(counts))
    group = Group()
    torch_nccl._gather_padded(group, send, recv, counts, max(counts), len(counts))
    assert len(group.given) == 2
    assert [id(t) for t in torch_nccl.HANDOFF._held] == [id(t) for t in group.given]
