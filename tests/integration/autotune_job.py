"""A NumPy training loop under HVDLITE_AUTOTUNE, run by tests/integration/test_autotune.py:
each step allreduces a 3 MiB "gradient" and a small one, then marks the step boundary
with ``hvd.step_done()`` (the signal a loop without hvdlite's optimizer gives), until
autotune has chosen. Each rank prints one line: ``DONE rank R steps N settings {...}``
with the settings in force at the end."""
from __future__ import annotations

import json
import os
import sys

import numpy as np

import hvdlite as hvd
from hvdlite.api import runtime
from hvdlite.diagnostics import autotune
from hvdlite.policy.tuning import TUNED

LIMIT = 5000      # steps: far more than a search takes; a hang is the test's timeout


def main() -> None:
    hvd.init()
    gradient = np.ones(3 << 18, dtype=np.float32)     # 3 MiB
    bias = np.ones(256, dtype=np.float32)
    steps = 0
    while not autotune.finished() and steps < LIMIT:
        hvd.allreduce_(gradient, name="gradient")
        hvd.allreduce_(bias, name="bias")
        gradient[:], bias[:] = 1.0, 1.0
        hvd.step_done()
        steps += 1
    config = runtime.config()
    settings = {name: getattr(config, name) for name in TUNED}
    os.write(1, f"DONE rank {hvd.rank()} steps {steps} settings {json.dumps(settings)}\n"
             .encode())
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
