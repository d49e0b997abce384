#!/usr/bin/env bash
# Installs Debian's SLURM daemons, munge and PMIx (srun --mpi=pmix, for Open MPI) if
# they are missing. Exit 0: ready; exit 3: cannot be installed here (not root, or no
# package source), tests skip.
set -u
# Debian's srun pmix plugin dlopens the unversioned libpmix.so, which libpmix-dev provides.
have_pmix() { ldconfig -p 2>/dev/null | grep -q 'libpmix\.so '; }
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
   && command -v sbatch >/dev/null && have_pmix; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "SLURM is not installed and cannot be (needs root and apt-get)" >&2
  exit 3
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || { echo "apt-get update failed" >&2; exit 3; }
apt-get install -y -qq slurmctld slurmd slurm-client munge libpmix-dev >/dev/null 2>&1 \
  || { echo "apt-get install slurmctld slurmd slurm-client munge libpmix-dev failed" >&2; exit 3; }
