"""hvdliterun's command building and the GPU pinning rule, without running MPI jobs."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hvdlite.runner import launch
from hvdlite.runner.mpi_impl import (env_arguments, find_launcher, flavor_flags, hosts_argument,
                                     library, library_from_version)
from hvdlite.transport.topology import device_for_local_rank


def _fake_launcher(tmp_path: Path, banner: str) -> str:
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_flavor_is_detected_from_the_launcher(tmp_path: Path) -> None:
    assert find_launcher(_fake_launcher(tmp_path, "mpiexec (Open MPI) 4.1.4")).flavor == "openmpi"
    assert find_launcher(_fake_launcher(tmp_path, "HYDRA build details:\n Version: 4.2")).flavor == "mpich"


def test_command_for_mpich_passes_knobs_and_hosts(tmp_path: Path) -> None:
    args = launch.parser().parse_args([
        "-np", "4", "-H", "a:2,b:2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "0.5",
        "--timeline-filename", "/tmp/t.json", "--timeline-mark-cycles", "--stall-check-seconds", "30",
        "--mpiexec", _fake_launcher(tmp_path, "HYDRA Version: 4"), "python", "train.py", "--lr", "1"])
    command = launch.build_command(args)
    assert command[1:3] == ["-n", "4"] and command[3:5] == ["-hosts", "a:2,b:2"]
    for name, value in [("HVDLITE_FUSION_THRESHOLD", "32.0MiB"), ("HVDLITE_CYCLE_TIME", "0.5"), ("HVDLITE_TIMELINE", "/tmp/t.json"),
                        ("HVDLITE_TIMELINE_MARK_CYCLES", "1"), ("HVDLITE_STALL_CHECK_TIME", "30.0")]:
        index = command.index(name)
        assert command[index - 1] == "-genv" and command[index + 1] == value
    assert command[-4:] == ["python", "train.py", "--lr", "1"]


def test_command_for_open_mpi_as_root_oversubscribed(tmp_path: Path) -> None:
    args = launch.parser().parse_args([
        "-np", "64", "--allreduce", "ring", "--mpiexec",
        _fake_launcher(tmp_path, "mpirun (Open MPI) 5.0"), "python", "t.py"])
    command = launch.build_command(args)
    assert "--oversubscribe" in command
    assert ("--allow-run-as-root" in command) == (os.geteuid() == 0)
    assert "-x" in command and "HVDLITE_ALLREDUCE=ring" in command


def test_launcher_argument_spellings() -> None:
    assert hosts_argument("mpich", None, "hosts.txt") == ["-f", "hosts.txt"]
    assert hosts_argument("openmpi", "a:2", None) == ["--host", "a:2"]
    with pytest.raises(ValueError, match="not both"):
        hosts_argument("mpich", "a:2", "hosts.txt")
    assert env_arguments("openmpi", {"B": "2", "A": "1"}) == ["-x", "A=1", "-x", "B=2"]
    assert flavor_flags("mpich", 99, 2) == []
    assert "--oversubscribe" not in flavor_flags("openmpi", 2, 4)
    assert flavor_flags("openmpi", 2, 4)[:2] == ["--bind-to", "none"]


@pytest.mark.parametrize("text,flavor,version,plugin", [
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11\x00",
     "openmpi", "Open MPI v5.0.11", "pmix"),
    ("MPICH Version:      5.0.2\nMPICH Release date: ...", "mpich", "MPICH Version: 5.0.2",
     "pmi2"),
    ("Intel(R) MPI Library 2021.13 for Linux* OS\n", "mpich",
     "Intel(R) MPI Library 2021.13 for Linux* OS", "pmi2"),
])
def test_library_and_its_srun_plugin(text: str, flavor: str, version: str, plugin: str) -> None:
    library = library_from_version(text)
    assert (library.flavor, library.version, library.srun_mpi) == (flavor, version, plugin)


@pytest.mark.parametrize("local_rank,local_size,visible,expected", [
    (0, 4, None, 0), (3, 4, None, 3),               # no restriction: one GPU per local rank
    (2, 4, "4,5,6,7", 2),                          # indices are relative to the visible list
    (3, 4, "2", 0),                                # the scheduler gave this rank its own GPU
    (3, 4, "0,1", 1),                              # fewer GPUs than ranks: round-robin
])
def test_device_for_local_rank(local_rank: int, local_size: int, visible: str | None,
                               expected: int) -> None:
    assert device_for_local_rank(local_rank, local_size, visible) == expected


def test_unmasked_ranks_share_the_gpus_the_driver_reports() -> None:
    assert device_for_local_rank(1, 2, None, present=1) == 0    # two ranks, one GPU
    assert device_for_local_rank(3, 4, None, present=2) == 1
    assert device_for_local_rank(3, 4, None, present=None) == 3  # unknown: one per rank


@pytest.mark.parametrize("visible", ["", " ", ",", " , ,", "-1", "NoDevFiles"])
def test_no_visible_gpu_is_an_error(visible: str) -> None:
    with pytest.raises(ValueError, match="hides every GPU"):
        device_for_local_rank(0, 2, visible)


def test_rendered_slurm_gpu_job() -> None:
    from hvdlite.runner.jobs import render
    script = render("slurm", nodes=2, tasks_per_node=None, gpus_per_node=4, cpus_per_task=None,
                    job_name="run1", time_limit="01:00:00", partition=None,
                    command=["python", "train.py", "--name", "a b"])
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gres=gpu:4",
                 "#SBATCH --job-name=run1", "#SBATCH --time=01:00:00"):
        assert line in script.splitlines()
    assert script.rstrip().endswith("exec srun python train.py --name 'a b'")
    plugin = library().srun_mpi    # the MPI this venv's mpi4py loads decides
    assert f'SLURM_MPI_TYPE="${{SLURM_MPI_TYPE:-{plugin}}}"' in script
    pmix = render("slurm", nodes=1, tasks_per_node=2, gpus_per_node=0, cpus_per_task=None,
                  job_name=None, time_limit=None, partition=None, command=["t"], srun_mpi="pmix")
    assert 'export SLURM_MPI_TYPE="${SLURM_MPI_TYPE:-pmix}"' in pmix.splitlines()


def test_rendered_mpirun_job_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from hvdlite.runner.jobs import main
    assert main(["mpirun", "--nodes", "2", "--tasks-per-node", "3", "--", "python", "t.py", "--x"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --ntasks-per-node=3" in script
    assert script.rstrip().endswith('exec hvdliterun -np "${SLURM_NTASKS}" python t.py --x')
    with pytest.raises(SystemExit):
        main(["slurm", "--gpus-per-node", "4", "--tasks-per-node", "2", "--", "python", "t.py"])
    assert main(["srun-mpi"]) == 0
    assert capsys.readouterr().out.strip() in ("pmi2", "pmix")     # whichever this venv loads
    assert main(["srun-mpi", "--mpi", "pmix"]) == 0 and capsys.readouterr().out == "pmix\n"


def test_rendered_elastic_job_requeues_on_usr1() -> None:
    from hvdlite.runner.jobs import render
    script = render("slurm", nodes=2, tasks_per_node=2, gpus_per_node=0, cpus_per_task=None,
                    job_name=None, time_limit="01:00:00", partition=None,
                    command=["python", "train.py"], elastic=True)
    for line in ["#SBATCH --requeue", "#SBATCH --signal=B:USR1@120", "#SBATCH --nodes=2",
                 "#SBATCH --time=01:00:00", 'scontrol requeue "$SLURM_JOB_ID"',
                 "srun python train.py &"]:
        assert line in script, line
    with pytest.raises(ValueError, match="--elastic"):
        render("mpirun", 1, None, 0, None, None, None, None, ["x"], elastic=True)


def test_elastic_launcher_flags_need_elastic_and_sane_values() -> None:
    from hvdlite.runner import elastic
    p = launch.parser()
    for argv in (["-np", "2", "--min-np", "1", "x"], ["-np", "2", "--elastic", "--min-np", "3", "x"],
                 ["-np", "2", "--elastic", "--max-restarts", "-1", "x"]):
        with pytest.raises(SystemExit):
            elastic.check_arguments(p, p.parse_args(argv))
