"""hvdlite under torchrun, on torch.distributed's transport (hvdlite/core/transport_torch.py):
the transport conformance checks, and hvdlite's collectives on a machine without
mpi4py (hidden by tests/integration/no_mpi4py)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import pytest

pytest.importorskip("torch.distributed", reason="torchrun needs torch")
ROOT = Path(__file__).resolve().parents[2]
NO_MPI4PY = Path(__file__).resolve().parent / "no_mpi4py"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def torchrun_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent makes a torchelastic_* folder per job under TMPDIR and leaves it:
    under the test's own tmp_path, which pytest removes."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(job: str, nproc: int, without_mpi4py: bool = False,
             succeeds: Optional[bool] = True,
             module: str = "tests.integration.torchrun_jobs", options: Sequence[str] = (),
             timeout: float = 120, **settings: str) -> str:
    """The job's output; within ``timeout`` s it must end with status 0 (``succeeds``) or
    not (None: either)."""
    path = [str(NO_MPI4PY)] if without_mpi4py else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [str(ROOT)]), OMP_NUM_THREADS="1",
               **settings)
    # The agent looks at its workers every 5 s, not 0.1: a job whose rank exits is
    # ended by it, and the survivors must get to say what they saw first.
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--monitor-interval=5", *options,
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
               "-m", module, job]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    assert succeeds is None or (proc.returncode == 0) == succeeds, output
    return output


@pytest.mark.parametrize("nproc", [2, 3])
def test_torch_distributed_passes_the_transport_conformance_checks(nproc: int) -> None:
    from tests.transport_conformance import CHECKS
    output = torchrun("conformance", nproc)
    for rank in range(nproc):
        for check in CHECKS:
            assert f"PASS rank {rank} {check.__name__}" in output, output
        assert f"PASS rank {rank} alltoall_reversed" in output, output


def test_hvdlite_runs_under_torchrun_without_mpi4py() -> None:
    """Three ranks, so that the process set of the first and last is not the world."""
    output = torchrun("collectives", 3, without_mpi4py=True)
    for rank in range(3):
        assert f"OK rank {rank} of 3 mpi4py_loaded=False local={rank}/3" in output, output


@pytest.mark.parametrize("nproc", [2, 3])
def test_alltoall_runs_on_the_torch_transport_as_numpy_says(nproc: int) -> None:
    output = torchrun("alltoall", nproc, without_mpi4py=True)
    for rank in range(nproc):
        assert f"ALLTOALL rank {rank} of {nproc}" in output, output


def test_a_backend_registered_on_one_rank_fails_init_on_every_rank() -> None:
    # Known, open: after init() fails here, a loaded machine sometimes sees a rank abort at
    # interpreter exit inside Gloo's teardown ("terminate called without an active
    # exception"), after every rank printed its error; the exit status is not checked.
    output = torchrun("registry_mismatch", 3, succeeds=None)
    for rank in range(3):
        assert f"MISMATCH rank {rank} ranks=[1] backends=['extra']: rank {rank}: " in output, \
            output
    assert "before hvdlite.init()" in output


def test_a_rank_that_exits_is_a_lost_peer_on_every_survivor() -> None:
    output = torchrun("lost_peer", 3, succeeds=False)
    for rank in (0, 2):
        lost = rf"LOST rank {rank}: rank {rank}: lost a peer: rank 1 \(pid \d+ on \S+\) exited"
        assert re.search(lost, output), output
    # The failure messages name the transport in use, not MPI.
    assert "MPI_Finalize" not in output and "an MPI call" not in output, output


def test_the_stall_inspector_fails_every_rank_on_a_tensor_one_never_submits() -> None:
    """The MPI jobs' own program (tests/integration/jobs.py), here under torchrun."""
    output = torchrun("stall_shutdown", 2, True, module="tests.integration.jobs",
                      HVDLITE_STALL_CHECK_TIME="0.5", HVDLITE_STALL_SHUTDOWN_TIME="1.5")
    for rank in range(2):
        assert f"STALL_ERROR rank {rank}" in output, output
    assert "'lonely'" in output and "missing ranks: [1]" in output


def test_init_outside_torchrun_without_mpi4py_says_how_to_get_it() -> None:
    """mpi4py is an extra (torchrun needs none): without it, init() outside torchrun is
    a UsageError naming the extras, not an ImportError from deep inside."""
    program = ("import hvdlite as hvd\ntry:\n    hvd.init()\nexcept hvd.UsageError as e:\n"
               "    print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    env["PYTHONPATH"] = os.pathsep.join([str(NO_MPI4PY), str(ROOT)])
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert "REFUSED" in done.stdout and "hvdlite[mpich]" in done.stdout, done.stdout + done.stderr


def _elastic_train(tmp_path: Path, name: str, **fault: str) -> tuple[str, dict]:
    """tests/integration/elastic_jobs.py's deterministic training under torchrun
    --max-restarts=1, committing to its own HVDLITE_ELASTIC_DIR."""
    import json
    out = tmp_path / f"{name}.json"
    output = torchrun("train", 2, module="tests.integration.elastic_jobs",
                      options=["--max-restarts=1"], timeout=240, HVDLITE_PEER_TIMEOUT="5",
                      HVDLITE_ELASTIC_DIR=str(tmp_path / name), ELASTIC_OUT=str(out),
                      ELASTIC_MARKER=str(tmp_path / f"{name}.fired"), **fault)
    return output, json.loads(out.read_text())


@pytest.mark.timeout(540)    # two jobs, one started twice: each start imports torch anew
def test_a_killed_rank_restarts_the_job_from_the_last_commit_under_torchrun(
        tmp_path: Path) -> None:
    """Rank 1 SIGKILLs itself after commit 5 once: the survivor fails (PeerLostError),
    torchrun restarts both workers, and the job resumes from commit 5 and ends with
    bitwise the parameters and samples of an uninterrupted run."""
    _, reference = _elastic_train(tmp_path, "reference")
    output, result = _elastic_train(tmp_path, "killed", ELASTIC_FAULT="kill_after_commit",
                                    ELASTIC_FAULT_AT="5")
    assert (tmp_path / "killed.fired").exists(), output
    starts = [line for line in output.splitlines() if line.startswith("START")]
    assert starts == ["START commits=0 epoch=0 processed=0",
                      "START commits=5 epoch=1 processed=16"], output
    assert "PeerLostError" in output
    assert result["params"] == reference["params"] and result["seen"] == reference["seen"]


def _hvdliterun_gloo(*flags: str, **settings: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **settings)
    return subprocess.run([sys.executable, "-m", "hvdlite.runner.launch", "--gloo", *flags,
                           sys.executable, "-m", "tests.integration.torchrun_jobs",
                           "horovod_launch_variables"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("nproc", [2, 4])
def test_hvdliterun_gloo_sets_horovods_launch_variables_and_passes_knobs(
        nproc: int, tmp_path: Path) -> None:
    """hvdliterun --gloo, as horovodrun --gloo: each rank's HOROVOD_RANK, _SIZE, _LOCAL_*,
    _CROSS_* before init() are what init() says; the knobs reach every rank; torchrun's
    torchelastic_* folder and the launcher's own are gone from TMPDIR afterwards."""
    proc = _hvdliterun_gloo("-np", str(nproc), "--cycle-time-ms", "2")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for rank in range(nproc):
        assert f"HOROVOD rank {rank} of {nproc} " in output and "knob=2.0" in output, output
    assert "ignoring HOROVOD_" not in output, output     # its own variables draw no warning
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_hvdliterun_gloo_exits_with_the_failing_ranks_status() -> None:
    proc = _hvdliterun_gloo("-np", "2", FAIL_RANK="1")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "HOROVOD rank 0 of 2" in proc.stdout + proc.stderr
