"""The multi-rank GPU code on the CPU stand-in (gpu_standin.py): every test here
runs under ``mpiexec``, in a process of its own, because the stand-in takes the
name ``cupy`` for the whole process. STANDIN_PLANT=<name> loads the NCCL backend
with one of gpu_standin.PLANTS' bugs (tests/integration/test_standin_plants.py)."""
from __future__ import annotations

import os

from tests.standin import gpu_standin

gpu_standin.install()
if os.environ.get("STANDIN_PLANT"):
    gpu_standin.plant(os.environ["STANDIN_PLANT"])

# The multi-rank session: one hvdlite.init(), outcomes agreed between ranks.
from tests.mpi.conftest import (  # noqa: E402,F401
    gpu_path, pytest_configure, pytest_runtest_makereport, pytest_unconfigure)
