"""torchrun (``python -m torch.distributed.run``) whose exit code is the job's: that of
the first worker that failed, 128 + N where signal N ended it (as a shell reports it).

torchrun itself ends with 1 whatever its workers' codes: it reports a failed worker
by an exception (ChildFailedError) that it leaves uncaught, and a signal that stopped
it (^C, SIGTERM) by another (SignalException), which gives 128 + N here. That exception holds each
failed worker's exit code and when it failed; the first failure is the job's, since
the other ranks' failures follow from it (they lost a peer). hvdliterun --gloo runs
torchrun through this module, ``python -m hvdlite.runner.torchrun TORCHRUN-ARGS``.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence


def exit_code(error: Any) -> int:
    """The job's exit code from torchrun's ChildFailedError."""
    _, failure = error.get_first_failure()
    code = int(failure.exitcode)
    return 128 - code if code < 0 else (code or 1)


def main(argv: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    try:
        torchrun(list(argv))
    except ChildFailedError as error:
        _say(str(error))                    # torchrun's table of the failed workers
        return exit_code(error)
    except SignalException as stopped:      # ^C or SIGTERM: torchrun stopped its workers
        _say(f"torchrun: {stopped}; its workers were stopped")
        return 128 + int(stopped.sigval)
    return 0


def _say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
