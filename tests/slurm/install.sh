#!/usr/bin/env bash
# Installs Debian's SLURM daemons and munge if they are missing. Exit 0: ready;
# exit 3: cannot be installed here (not root, or no package source), tests skip.
set -u
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
   && command -v sbatch >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "SLURM is not installed and cannot be (needs root and apt-get)" >&2
  exit 3
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || { echo "apt-get update failed" >&2; exit 3; }
apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
  || { echo "apt-get install slurmctld slurmd slurm-client munge failed" >&2; exit 3; }
