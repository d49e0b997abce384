"""Shared by every multi-rank test: one hvdlite.init() per session, and each
test's outcome exchanged between ranks so that a failure anywhere fails it
everywhere (tests are size-agnostic: expected values come from rank and size)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.api.control import reconfigure
from tests.mpi.outcomes import channel, under_torchrun
from tests.mpi.watchdog import Watchdog, timeout_of

_RESULTS = channel()   # test bookkeeping only, never used by hvdlite


def pytest_configure(config: pytest.Config) -> None:
    hvd.init()


def pytest_unconfigure(config: pytest.Config) -> None:
    hvd.shutdown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any):  # type: ignore[no-untyped-def]
    """A test that outlives its timeout: every rank says where it was (watchdog.py)."""
    timeout_s = timeout_of(item)
    watchdog = Watchdog(item, _RESULTS.rank, timeout_s) if timeout_s else None
    try:
        yield
    finally:
        if watchdog is not None:
            watchdog.cancel()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.when not in ("setup", "call") or report.skipped:
        return
    text = report.longreprtext if report.failed else ""
    # Ranks that finish a test first wait here asleep: in a blocking allgather MPICH
    # busy-polls, and at -n 4 on two cores that took the CPU from the ranks still
    # working (the -n 4 run took 10-15% longer).
    _RESULTS.idle_until_all_arrive()
    results = _RESULTS.allgather((_RESULTS.rank, report.failed, text))
    remote = [(r, t) for r, failed, t in results if failed and r != _RESULTS.rank]
    if remote:
        detail = "\n".join(f"--- rank {r} ---\n{t}" for r, t in remote)
        report.outcome = "failed"
        report.longrepr = f"{report.longreprtext}\n[failed on rank(s) {[r for r, _ in remote]}]\n{detail}"


# Under torchrun the MPI-based backends decline the torch transport's sets and every call
# runs on its own collectives (hvdlite/backends/on_transport.py): once, not three times.
@pytest.fixture(params=["transport"] if under_torchrun() else ["mpi", "ring", "ps"])
def backend(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Run a test once per allreduce backend, switched by a negotiated
    reconfiguration (every rank switches at the same point between collectives)."""
    if request.param == "transport":
        yield request.param
        return
    previous = runtime.config().allreduce
    reconfigure(allreduce=request.param)
    yield request.param
    reconfigure(allreduce=previous)


@pytest.fixture(params=["nccl", "mpi"])
def gpu_path(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Run a GPU test once per GPU path, switched by a negotiated reconfiguration:
    NCCL ("nccl": CuPy's on MPI, torch's under torchrun) and staged through the host
    ("mpi")."""
    previous = runtime.config().gpu_allreduce
    reconfigure(gpu_allreduce=request.param)
    yield request.param
    reconfigure(gpu_allreduce=previous)


@pytest.fixture
def rank_size() -> tuple[int, int]:
    return hvd.rank(), hvd.size()


def rank_data(rank: int, shape: tuple[int, ...], dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Deterministic small integer-valued data for ``rank``: every rank can
    rebuild every other rank's input to compute the expected result."""
    rng = np.random.default_rng(1000 * salt + rank)
    values = rng.integers(1, 4, size=shape)
    if np.issubdtype(np.dtype(dtype), np.signedinteger) or np.issubdtype(np.dtype(dtype), np.floating):
        values = values * rng.choice([-1, 1], size=shape)
    return values.astype(dtype)


def digests(arrays: list) -> list[str]:
    """Every rank's digest of its ``arrays``' bytes, in rank order."""
    import hashlib
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))
    return hvd.allgather_object(digest.hexdigest())


def assert_identical_everywhere(arrays: list) -> None:
    """Every rank holds bitwise the same arrays (a digest compared across ranks)."""
    every = digests(arrays)
    assert len(set(every)) == 1, f"parameters differ across ranks: {every}"


def keras_optimizers(keras: object) -> dict:
    """The optimizers the Keras equivalence tests train with, by name."""
    return {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),  # type: ignore[attr-defined]
            "adam": lambda: keras.optimizers.Adam(0.01)}  # type: ignore[attr-defined]


def keras_on_tensorflow() -> tuple:
    """(tensorflow, keras) for a module whose tests run Keras on the TensorFlow backend,
    one intra-op thread per rank. Skips the module where TensorFlow is not installed
    (make test's Open MPI venv) or Keras runs on another backend."""
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tf = pytest.importorskip("tensorflow", reason=(
        "TensorFlow is not installed in this venv (make test's Open MPI venv, .venv-ompi, "
        "has NumPy and torch only)"))
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("these tests run Keras on the TensorFlow backend", allow_module_level=True)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    return tf, keras


@pytest.fixture
def small_chunks() -> Iterator[None]:
    """HVDLITE_BUCKET_BYTES of 40 (ZeroRedundancyOptimizer's chunks, buckets): every
    parameter spans several, every chunk some ranks."""
    previous = runtime.config().bucket_bytes
    reconfigure(bucket_bytes=40)
    yield
    reconfigure(bucket_bytes=previous)


@pytest.fixture
def elastic_dir():  # type: ignore[no-untyped-def]
    """A directory every rank names the same (rank 0's temporary directory, broadcast) as
    HVDLITE_ELASTIC_DIR; rank 0 removes it once every rank is done with it."""
    import shutil
    import tempfile
    from hvdlite.elastic import preemption
    path = tempfile.mkdtemp(prefix="hvdlite-elastic-t-") if hvd.rank() == 0 else None
    directory = hvd.broadcast_object(path, name="elastic.dir.t")
    reconfigure(elastic_dir=directory)
    try:
        yield directory
    finally:
        reconfigure(elastic_dir="")
        preemption._requested.clear()
        hvd.barrier()
        if hvd.rank() == 0:
            shutil.rmtree(directory)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under torchrun, every test of Adasum (by name or parameter) skips: its backend runs
    on an MPI communicator. Files made of mpi4py's objects are not run under torchrun at
    all (GLOO_TESTS in the Makefile)."""
    if not under_torchrun():
        return
    for item in items:
        for what in ("adasum",):
            if what in item.nodeid.lower():
                item.add_marker(pytest.mark.skip(reason=(
                    f"needs MPI, not torchrun's Gloo: the torch transport has no {what} yet")))


@contextlib.contextmanager
def handed() -> Iterator[tuple[list[str], list[str], list[str]]]:
    """The names of what this rank hands the engine while inside: everything in order,
    the requests to negotiate, and the collectives on a lane (hvdlite/engine/lane.py)."""
    engine, names, negotiated, on_lanes = runtime.engine(), [], [], []
    submit, submit_lane = engine.submit, engine.submit_lane

    def to_negotiate(request: Any, finish: Any = None) -> int:
        names.append(request.desc.name)
        negotiated.append(request.desc.name)
        return submit(request, finish)

    def on_lane(lane_id: int, op: Any) -> int:
        names.append(op.name)
        on_lanes.append(op.name)
        return submit_lane(lane_id, op)
    engine.submit, engine.submit_lane = to_negotiate, on_lane   # instance attributes shadow
    try:
        yield names, negotiated, on_lanes
    finally:
        del engine.submit, engine.submit_lane


@contextlib.contextmanager
def submissions() -> Iterator[list[str]]:
    """The names of what this rank hands the engine while inside, negotiated or on a
    lane alike, in order."""
    with handed() as (names, _, _):
        yield names


@pytest.fixture(params=[True, False], ids=["lane", "negotiated"])
def lane(request: pytest.FixtureRequest) -> Iterator[bool]:
    """HVDLITE_LANE on or off for the test (every host transport has a lane)."""
    previous = runtime.config().lane
    reconfigure(lane=request.param)
    yield request.param
    reconfigure(lane=previous)
