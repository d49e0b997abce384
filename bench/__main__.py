"""Entry point, from the repository root: ``python -m bench
{allreduce|training|traffic|forecast-check|keras|gpu|local-sgd|zero-memory} [options]``
(README.md says what each measures). The scaling forecast itself is the library's: ``python -m hvdlite.forecast``."""
from __future__ import annotations

import sys

from typing import Sequence

from bench import training


def _allreduce(argv: Sequence[str]) -> None:
    # Imported when asked: allreduce.py imports mpi4py's MPI, which starts an MPI world,
    # and a worker under torchrun must not. --transports: a driver of launches, no MPI.
    if any(a == "--transports" or a.startswith("--transports=") for a in argv):
        from bench import allreduce_transports
        allreduce_transports.main(argv)
        return
    from bench import allreduce
    allreduce.main(argv)


def _allreduce_worker(argv: Sequence[str]) -> None:
    from bench import allreduce_transports
    allreduce_transports.worker(argv)


def _keras(argv: Sequence[str]) -> None:
    from bench import keras    # imports TensorFlow in the workers only
    keras.main(argv)


def _keras_worker(argv: Sequence[str]) -> None:
    from bench import keras
    keras.worker(argv)


def _gpu(argv: Sequence[str]) -> None:
    from bench import gpu    # imports torch.distributed and CuPy: only when asked
    gpu.main(argv)


def _traffic(argv: Sequence[str]) -> None:
    from bench import traffic
    traffic.main(argv)


def _local_sgd(argv: Sequence[str]) -> None:
    from bench import local_sgd
    local_sgd.main(argv)


def _zero_memory(argv: Sequence[str]) -> None:
    from bench import zero_memory
    zero_memory.main(argv)


def _zero_memory_worker(argv: Sequence[str]) -> None:
    from bench import zero_memory
    zero_memory.worker(argv)


def _forecast_check(argv: Sequence[str]) -> None:
    from bench import forecast_check
    forecast_check.main(argv)


COMMANDS = {"allreduce": _allreduce, "allreduce-worker": _allreduce_worker,
            "training": training.main,
            "training-worker": training.worker, "traffic": _traffic,
            "forecast-check": _forecast_check, "keras": _keras,
            "keras-worker": _keras_worker, "gpu": _gpu, "local-sgd": _local_sgd,
            "zero-memory": _zero_memory, "zero-memory-worker": _zero_memory_worker}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: python -m bench {{{'|'.join(COMMANDS)}}} [options]")
    COMMANDS[sys.argv[1]](sys.argv[2:])
