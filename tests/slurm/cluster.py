"""A real SLURM cluster on this host: one slurmctld and two slurmd playing nodes
n1 and n2 (Debian's build allows several slurmd per host), for the job tests."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

NODES = ("n1", "n2")
CPUS_PER_NODE = 2
# Daemons of a run that was killed (a timeout, ^C) would hold the ports: remember
# what we start and end it at the next start.
PIDFILE = Path("/tmp/hvdlite-slurm-daemons.pids")
# Beside slurm.conf, read by srun --mpi=pmix. Open MPI 5's PMIx client wants the
# security mode its server speaks named; without it every rank prints a warning.
MPI_CONF = "PMIxEnv=PMIX_SECURITY_MODE=native\n"


def _config(root: Path, host: str, base_port: int) -> str:
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={base_port + 1 + i} "
        f"CPUs={CPUS_PER_NODE} State=UNKNOWN" for i, name in enumerate(NODES))
    return f"""ClusterName=hvdlite
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={base_port}
AuthType=auth/munge
# A requeued job may start again cred_expire + 1 s after its requeue (slurm.conf(5);
# default 120 s, which the preempted elastic test spent waiting). 20 s still leaves a
# step's credential time to reach a slurmd on a loaded machine.
AuthInfo=cred_expire=20
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
EnforcePartLimits=ALL
MinJobAge=5
ReturnToService=2
MpiDefault=none
SlurmdParameters=config_overrides
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
TmpFS={root}/tmp/%n
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    def __init__(self, root: Path, base_port: int = 16817) -> None:
        self.root = root
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
        # The templates choose srun's plugin for the MPI in use; the tests check that
        # choice, so a value from the outside environment must not preempt it.
        self.env.pop("SLURM_MPI_TYPE", None)
        self.base_port = base_port
        self._daemons: list[subprocess.Popen[bytes]] = []

    def start(self, timeout: float = 60) -> None:
        _end_stale_daemons()
        for sub in ["state", "spool/n1", "spool/n2", "tmp/n1", "tmp/n2"]:
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        (self.root / "slurm.conf").write_text(_config(self.root, host, self.base_port))
        (self.root / "mpi.conf").write_text(MPI_CONF)
        self._start_munge()
        self._spawn(["slurmctld", "-D", "-i"])
        for node in NODES:
            self._spawn(["slurmd", "-D", "-N", node])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
            idle = [line for line in states.splitlines() if line.split()[-1:] == ["idle"]]
            if len(idle) == len(NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"SLURM nodes not idle after {timeout} s:\n{states}\n" + self.logs())

    def _start_munge(self) -> None:
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create", "--force"], check=True)
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            subprocess.run(["munged", "--force"], check=True)

    def _spawn(self, argv: list[str]) -> None:
        log = open(self.root / f"{argv[0]}-{len(self._daemons)}.out", "wb")
        daemon = subprocess.Popen(argv, env=self.env, stdout=log, stderr=log)
        self._daemons.append(daemon)
        with PIDFILE.open("a") as pids:
            pids.write(f"{daemon.pid}\n")

    def run(self, argv: list[str], check: bool = True, timeout: float = 300,
            **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              check=check, timeout=timeout, **kwargs)  # type: ignore[arg-type]

    def sbatch(self, script: str, args: list[str], sbatch_options: list[str],
               cwd: Path, extra_env: dict[str, str] | None = None,
               timeout: float = 120, stuck: Callable[[str], bool] | None = None,
               stuck_s: float = 30.0) -> tuple[int, str]:
        """Submit with --wait; returns (the job's exit code, its output). A job still
        running after ``timeout`` is cancelled and reported as exit code 124, and so is
        one whose output ``stuck`` has said for ``stuck_s`` seconds is stuck."""
        out = self.root / f"job-{time.monotonic_ns()}.out"
        env = dict(self.env, **(extra_env or {}))
        proc = subprocess.Popen(["sbatch", "--wait", "-o", str(out), *sbatch_options, script,
                                 *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        why = _watch(proc, out, time.monotonic() + timeout, stuck, stuck_s)
        if why is None:
            stderr = proc.communicate()[1]
            code = proc.returncode
        else:
            proc.kill()                 # as subprocess.run's timeout did, then the job
            proc.communicate()
            self.run(["scancel", "--user", str(os.getuid())], check=False)
            time.sleep(2)
            code, stderr = 124, f"[cancelled: {why}]"
        return code, (out.read_text() if out.exists() else "") + stderr

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        for daemon in self._daemons:
            daemon.terminate()
        for daemon in self._daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        PIDFILE.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


def _watch(proc: subprocess.Popen, out: Path, deadline: float,
           stuck: Callable[[str], bool] | None, stuck_s: float) -> str | None:
    """Wait for sbatch to end; why it must be cancelled instead, or None if it ended."""
    stuck_since = None
    while proc.poll() is None:
        now = time.monotonic()
        if now >= deadline:
            return "still running at its timeout"
        if stuck is not None and out.exists() and stuck(out.read_text(errors="replace")):
            stuck_since = now if stuck_since is None else stuck_since
            if now - stuck_since >= stuck_s:
                return f"stuck for {stuck_s:g} s"
        else:
            stuck_since = None
        time.sleep(0.5)
    return None


def _end_stale_daemons() -> None:
    if not PIDFILE.exists():
        return
    for line in PIDFILE.read_text().split():
        try:
            os.kill(int(line), 9)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    PIDFILE.unlink(missing_ok=True)
    time.sleep(0.5)
