"""Benchmarks, outside the installed package: ``mpiexec -n 2 python -m bench allreduce``
from the repository root (README.md)."""
