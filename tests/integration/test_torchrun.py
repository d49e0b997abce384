"""hvdlite under torchrun, on torch.distributed's transport (hvdlite/transport/torch_transport.py):
the transport conformance checks, and hvdlite's collectives on a machine without
mpi4py (hidden by tests/integration/no_mpi4py)."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import pytest

from hvdlite.runner.supervise import process_tree
from tests.integration import frozen
from tests.processes import free_port

pytest.importorskip("torch.distributed", reason="torchrun needs torch")
ROOT = Path(__file__).resolve().parents[2]
NO_MPI4PY = Path(__file__).resolve().parent / "no_mpi4py"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def torchrun_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent makes a torchelastic_* folder per job under TMPDIR and leaves it:
    under the test's own tmp_path, which pytest removes."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def torchrun(job: str, nproc: int, without_mpi4py: bool = False,
             succeeds: Optional[bool] = True,
             module: str = "tests.integration.torchrun_jobs", options: Sequence[str] = (),
             timeout: float = 120, survivors_speak: bool = False, **settings: str) -> str:
    """The job's output; within ``timeout`` s it must end with status 0 (``succeeds``) or
    not (None: either). torchrun's agent ends the other workers with SIGTERM at its
    first look after one fails; ``survivors_speak``: they ignore it (torchrun_jobs.py),
    so a test of what the survivors say hears them out, however loaded the machine."""
    path = [str(NO_MPI4PY)] if without_mpi4py else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [str(ROOT)]), OMP_NUM_THREADS="1",
               **settings)
    if survivors_speak:
        env["SURVIVORS_SPEAK"] = "1"
    for _ in range(3):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   "--monitor-interval=0.5", *options,
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                   "-m", module, job]
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        output = proc.stdout + proc.stderr
        # The port was free when picked; another process may take it before torchrun's
        # store binds it (a clean-clone CI run, 9fe162a): that launch never started.
        if "EADDRINUSE" not in output:
            break
    assert succeeds is None or (proc.returncode == 0) == succeeds, output
    return output


# Three ranks: a size that is not a power of two, and sets that are not the world (the
# checks themselves are size-agnostic; the multi-rank suites run at 2 and 4 under torchrun).
@pytest.mark.parametrize("nproc", [3])
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


def test_hvdlite_under_torchrun_starts_no_mpi_where_mpi4py_is_installed() -> None:
    """The MPI-based host backends are never asked on torchrun's world; made anyway,
    they imported mpi4py's MPI, which started a singleton MPI in every worker (and with
    it, now and then, an abort at exit: 'terminate called without an active
    exception')."""
    pytest.importorskip("mpi4py", reason="needs mpi4py installed (the Gloo venv has none)")
    output = torchrun("collectives", 3)       # three: a process set that is not the world
    for rank in range(3):
        assert f"MPI rank {rank} started=False" in output, output
        assert f"OK rank {rank} of 3 mpi4py_loaded=" in output, output


@pytest.mark.parametrize("nproc", [3])     # uneven splits among three ranks
def test_alltoall_runs_on_the_torch_transport_as_numpy_says(nproc: int) -> None:
    output = torchrun("alltoall", nproc, without_mpi4py=True)
    for rank in range(nproc):
        assert f"ALLTOALL rank {rank} of {nproc}" in output, output


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_architecture_pages_example_backend_runs_under_torchrun(nproc: int) -> None:
    output = torchrun("architecture_backend", nproc, without_mpi4py=True)
    for rank in range(nproc):
        assert f"EXAMPLE BACKEND rank {rank} passed" in output, output


def test_a_backend_registered_on_one_rank_fails_init_on_every_rank() -> None:
    # Known, open: after init() fails here, a loaded machine sometimes sees a rank abort at
    # interpreter exit inside Gloo's teardown ("terminate called without an active
    # exception"), after every rank printed its error; the exit status is not checked.
    output = torchrun("registry_mismatch", 3, succeeds=None, survivors_speak=True)
    for rank in range(3):
        assert f"MISMATCH rank {rank} ranks=[1] backends=['extra']: rank {rank}: " in output, \
            output
    assert "before hvdlite.init()" in output


def test_a_rank_that_exits_is_a_lost_peer_on_every_survivor() -> None:
    output = torchrun("lost_peer", 3, succeeds=False, survivors_speak=True)
    for rank in (0, 2):
        lost = rf"LOST rank {rank}: rank {rank}: lost a peer: rank 1 \(pid \d+ on \S+\) exited"
        assert re.search(lost, output), output
    # The failure messages name the transport in use, not MPI.
    assert "MPI_Finalize" not in output and "an MPI call" not in output, output


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("setting", ["1", "0"])
def test_host_data_goes_through_the_nodes_shared_memory_unless_turned_off(
        nproc: int, setting: str) -> None:
    output = torchrun("shared_memory", nproc, without_mpi4py=True,
                      HVDLITE_SHARED_MEMORY=setting)
    for rank in range(nproc):
        # Turned off, nothing is opened; on, the world's and (odd ranks at 4) the set's.
        opened = [] if setting == "0" else [True] * (2 if nproc == 4 and rank % 2 else 1)
        world_round = "TorchRound" if setting == "0" else "NodeRound"
        # Gloo's groups: the world's and the global set's; the splits init() makes and
        # frees, and a removed set's, are gone (each kept a thread waking 100 times a
        # second).
        assert (f"SHM rank {rank} opened={opened} round={world_round} gloo loops: "
                "2 after init, 2 after a set came and went") in output, output


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_rank_whose_segment_its_peers_cannot_open_makes_every_rank_use_gloo(
        nproc: int) -> None:
    """The last rank is undumpable: no other process may open its files through /proc
    (the ranks run without CAP_SYS_PTRACE, as an ordinary user's do). Every rank falls
    back to Gloo together (the world, and at 4 the odd ranks' set), rank 0 says why,
    the results are right, and no rank holds a segment."""
    last = nproc - 1
    output = torchrun("shared_memory", nproc, without_mpi4py=True, UNDUMPABLE_RANK=str(last),
                      HVDLITE_LOG_LEVEL="info")
    for rank in range(nproc):
        opened = [False] * (2 if nproc == 4 and rank % 2 else 1)
        assert f"SHM rank {rank} opened={opened} round=TorchRound " in output, output
        assert f"SEGMENTS rank {rank} held=0" in output, output
    why = "INFO: hvdlite: host data over gloo, not shared memory: rank 0 could not map rank"
    assert f"[hvdlite rank 0] {why} {last}'s segment: [Errno 13] Permission denied" in output, \
        output
    if nproc == 4:     # the odd ranks' set says it by its own rank 0, in its own numbering
        assert f"[hvdlite rank 1] {why} 1's segment: [Errno 13] Permission denied" in output, \
            output


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_rank_killed_in_the_shared_memory_set_up_leaves_nothing(
        nproc: int, tmp_path: Path) -> None:
    """Rank 1 dies at the set-up's second exchange, holding the segment it made: nothing
    that appeared in /dev/shm while it set up is left once the job has ended (what MPI
    jobs or live processes elsewhere on the machine hold is theirs)."""
    import fnmatch
    import json

    from hvdlite.runner import leftovers
    seen_file = tmp_path / "seen.json"
    output = torchrun("dies_in_shared_memory_setup", nproc, without_mpi4py=True,
                      succeeds=False, SHM_SEEN=str(seen_file))
    assert seen_file.exists(), output
    seen = json.loads(seen_file.read_text())
    shm = Path("/dev/shm")

    def mpis(name: str) -> bool:            # another job's (leftovers.PLACES: MPI's only)
        return any(fnmatch.fnmatch(name, pattern) for pattern in leftovers.PLACES[shm])

    # It had made its segment: it held it, or it had appeared in /dev/shm.
    assert seen["held"] or [name for name in seen["new"] if not mpis(name)], output
    in_use = leftovers.mapped()

    def left(name: str, inode: int) -> bool:
        try:
            same = (shm / name).stat().st_ino == inode
        except OSError:
            return False
        return same and str(shm / name) not in in_use and not mpis(name)

    assert [name for name, inode in seen["new"].items() if left(name, inode)] == [], output


def test_a_rank_that_exits_inside_a_shared_memory_allreduce_is_a_lost_peer() -> None:
    """The survivors wait for its arrival in shared memory, not in Gloo: they find its
    process gone (hvdlite/transport/node_memory.py) and report the loss with its cause."""
    output = torchrun("lost_in_shared_memory", 3, succeeds=False, survivors_speak=True)
    for rank in (0, 2):
        lost = rf"LOST rank {rank}: rank {rank}: lost a peer: rank 1 \(pid \d+ on \S+\) exited"
        assert re.search(lost, output), output


# Every pair of transport, size and victim, in four runs of about 11 s rather than eight.
@pytest.mark.parametrize("setting, nproc, victim", [
    ("1", 2, "first"), ("1", 4, "last"), ("0", 2, "last"), ("0", 4, "first")],
    ids=["shm-2-first", "shm-4-last", "gloo-2-last", "gloo-4-first"])
def test_a_rank_stopped_inside_a_large_allreduce_is_a_lost_peer_on_every_other(
        setting: str, nproc: int, victim: str) -> None:
    """The MPI jobs' own program (tests/integration/jobs.py): the stopped rank's peers
    wait inside the 64 MiB allreduce, in the node's shared memory (1) or in Gloo (0)."""
    rank = 0 if victim == "first" else nproc - 1
    env = dict(os.environ, OMP_NUM_THREADS="1", HVDLITE_SHARED_MEMORY=setting)
    output = frozen.run_frozen(_frozen_job(nproc), nproc, rank, env)
    frozen.check_survivors(output, nproc, rank)


def test_a_rank_stopped_inside_a_broadcast_of_objects_is_a_lost_peer_on_every_other() -> None:
    """The others wait inside Gloo's broadcast of the 64 MiB pickled object."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    output = frozen.run_frozen(_frozen_job(2), 2, 1, env, op="broadcast_object")
    frozen.check_survivors(output, 2, 1)


def _frozen_job(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--monitor-interval=0.5", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", "-m", "tests.integration.jobs",
            "frozen_in_collective"]


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
                      survivors_speak=bool(fault),     # the survivor names the lost peer
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
    assert proc.returncode == 7, proc.stdout + proc.stderr      # rank 1's sys.exit(7)
    assert "HOROVOD rank 0 of 2" in proc.stdout + proc.stderr


def _agent(tmp_path: Path, name: str, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """One node of an elastic torchrun job (--nnodes=1:2, one rank) on this host; its
    output goes to tmp_path/NAME.log. The rendezvous store is the test's."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
               "--nproc_per_node=1", "--max-restarts=3", "--monitor-interval=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=resize",
               "--rdzv-conf=is_host=false,last_call_timeout=10",
               "-m", "tests.integration.resize_jobs", "train"]
    with open(tmp_path / f"{name}.log", "wb") as log:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _kill_with_its_workers(agent: subprocess.Popen[bytes]) -> None:
    """SIGKILL an agent and the workers it started (torchrun starts each worker in a
    session of its own, so killing the agent's process group would miss them)."""
    for pid in process_tree(agent.pid):        # the agent first: it starts no more
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"== {log.name}\n{log.read_text()}" for log in sorted(tmp_path.glob("*.log")))


@pytest.mark.timeout(420)    # three agents, five starts of a worker, each importing torch
def test_a_lost_node_shrinks_the_job_and_a_joining_node_grows_it_under_torchrun(
        tmp_path: Path) -> None:
    """torchrun --nnodes=1:2, one rank per node, on a rendezvous store the test holds.
    After commit 2 the last rank's node is lost (its agent, then the rank, SIGKILLed): the
    survivor fails with PeerLostError, its agent restarts it alone, and it resumes from
    commit 2 at size 1. After commit 7 a third node joins: torchrun restarts the job at
    size 2 and it resumes from commit 7. Every sample of each epoch is seen exactly once,
    the reset callbacks run at each resume, and both ranks end with the same parameters
    at the rate of two ranks (tests/integration/resize_jobs.py)."""
    import json
    import time
    import torch.distributed as dist
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    hosts, out = tmp_path / "hosts", tmp_path / "result"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HVDLITE_PEER_TIMEOUT="5",
               HVDLITE_ELASTIC_DIR=str(tmp_path / "state"), RESIZE_HOSTS=str(hosts),
               RESIZE_OUT=str(out), RESIZE_PLAN="2:2:lose-node,1:7:wait-for-node",
               # torch 2.13's agents share the rendezvous store with their workers by default;
               # a node that joins a running job as rank 1 then waits for a MASTER_ADDR the
               # staying rank 0 never writes again (it built it once): the job hangs.
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    agents = [_agent(tmp_path, name, port, env) for name in ("a", "b")]
    try:
        deadline = time.monotonic() + 240
        while not (hosts.exists() and hosts.read_text() == "waiting\n"):
            assert time.monotonic() < deadline, _logs(tmp_path)
            time.sleep(0.5)
        agents.append(_agent(tmp_path, "c", port, env))
        codes = sorted(agent.wait(timeout=150) for agent in agents)
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_with_its_workers(agent)
        del store
    output = _logs(tmp_path)
    assert codes == [-9, 0, 0], output         # the lost node's agent, the survivor, the new one
    starts = sorted((line for line in output.splitlines() if line.startswith("START")),
                    key=lambda line: int(line.split("commits=")[1].split()[0]))
    assert starts == ["START size=2 commits=0 epoch=0 processed=0 lr=0.02",
                      "START size=1 commits=2 epoch=0 processed=32 lr=0.01",
                      "START size=2 commits=7 epoch=1 processed=16 lr=0.02"], output
    assert "PeerLostError" in output
    results = [json.loads((tmp_path / f"result.{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["size"] for r in results] == [2, 2] and [r["lr"] for r in results] == [0.02] * 2
    assert results[0]["params"] == results[1]["params"]
    steps = [(epoch, sorted(indices)) for epoch, *indices in results[0]["seen"]]
    for epoch in (0, 1):
        seen = sorted(i for e, indices in steps if e == epoch for i in indices)
        assert seen == list(range(48)), (epoch, seen)
    assert [(e, len(i)) for e, i in steps] == [(0, 8)] * 4 + [(0, 4)] * 4 + [(1, 4)] * 4 + [(1, 8)] * 4
