"""Entry point: ``python -m hvdlite.bench {allreduce|training|traffic|forecast|keras|gpu}
[options]``."""
from __future__ import annotations

import sys

from typing import Sequence

from hvdlite.bench import training


def _allreduce(argv: Sequence[str]) -> None:
    # Imported when asked: allreduce.py imports mpi4py's MPI, which starts an MPI world,
    # and a worker under torchrun must not. --transports: a driver of launches, no MPI.
    if any(a == "--transports" or a.startswith("--transports=") for a in argv):
        from hvdlite.bench import allreduce_transports
        allreduce_transports.main(argv)
        return
    from hvdlite.bench import allreduce
    allreduce.main(argv)


def _allreduce_worker(argv: Sequence[str]) -> None:
    from hvdlite.bench import allreduce_transports
    allreduce_transports.worker(argv)


def _keras(argv: Sequence[str]) -> None:
    from hvdlite.bench import keras    # imports TensorFlow in the workers only
    keras.main(argv)


def _keras_worker(argv: Sequence[str]) -> None:
    from hvdlite.bench import keras
    keras.worker(argv)


def _gpu(argv: Sequence[str]) -> None:
    from hvdlite.bench import gpu    # imports torch.distributed and CuPy: only when asked
    gpu.main(argv)


def _traffic(argv: Sequence[str]) -> None:
    from hvdlite.bench import traffic
    traffic.main(argv)


def _forecast(argv: Sequence[str]) -> None:
    from hvdlite.bench import forecast     # one process, no MPI
    forecast.main(argv)


def _forecast_check(argv: Sequence[str]) -> None:
    from hvdlite.bench import forecast_check
    forecast_check.main(argv)


COMMANDS = {"allreduce": _allreduce, "allreduce-worker": _allreduce_worker,
            "training": training.main,
            "training-worker": training.worker, "traffic": _traffic, "forecast": _forecast,
            "forecast-check": _forecast_check, "keras": _keras,
            "keras-worker": _keras_worker, "gpu": _gpu}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: python -m hvdlite.bench {{{'|'.join(COMMANDS)}}} [options]")
    COMMANDS[sys.argv[1]](sys.argv[2:])
