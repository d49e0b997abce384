"""Benchmarks: ``mpiexec -n 2 python -m hvdlite.bench allreduce``."""
